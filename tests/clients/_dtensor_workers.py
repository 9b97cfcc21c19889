"""A trainer rank holding DTensor parameters on a CPU Gloo mesh (run in spawned processes)."""

from __future__ import annotations

import traceback
from typing import Any

import torch

# name -> (global shape, placements over a 2 x 2 mesh); uneven shards on purpose
PARAMS: dict[str, tuple[tuple[int, ...], tuple[str, str]]] = {
    "block.a": ((9, 7), ("S0", "S1")),
    "block.b": ((7, 4), ("S0", "R")),
    "block.c": ((5, 3), ("R", "R")),
    "block.d": ((11,), ("S0", "S0")),
    "block.e": ((3, 8), ("R", "S1")),
    "tiny": ((1, 6), ("S0", "R")),  # rank row 1 of the mesh holds an empty shard of it
}
FSDP = "fsdp.weight"  # an nn.Linear(9, 5) sharded by FSDP2's fully_shard on the 4 ranks


def global_weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    out = {
        n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, (shape, _) in PARAMS.items()
    }
    out[FSDP] = torch.randn((5, 9), generator=g).to(torch.bfloat16)
    return out


def trainer_rank(rank: int, port: int, controller: str, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from clients.dtensor_adapter import register_dtensor_module
    from refitd.client import TrainerClient

    trainer = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4
        )
        mesh = init_device_mesh("cpu", (2, 2))
        weights = global_weights(1)
        module = torch.nn.Module()
        module.block = torch.nn.Module()
        kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
        for name, (_, placements) in PARAMS.items():
            dt = distribute_tensor(weights[name], mesh, [kinds[p] for p in placements])
            parent = module.block if name.startswith("block.") else module
            parent.register_parameter(name.split(".")[-1], torch.nn.Parameter(dt))
        fsdp = _fsdp_linear(weights[FSDP])
        module.fsdp = fsdp
        trainer = TrainerClient(controller, "dtensor", rank=rank, pool_size=4, device=f"cpu:{rank}")
        register_dtensor_module(trainer, module)
        dist.barrier()
        results.put((rank, "v1", trainer.refit(1, wait="committed", timeout=60).state))
        # an in-place update of every shard, as an optimizer step does
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(2).add_(1)
        dist.barrier()
        results.put((rank, "v2", trainer.refit(2, wait="committed", timeout=60).state))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _fsdp_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, mesh: Any = None
) -> torch.nn.Module:
    """A BF16 nn.Linear holding `weight` (and `bias`), sharded by FSDP2 over a 4-rank mesh:
    each rank registers its real FSDP2 shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out_f, in_f = weight.shape
    lin = torch.nn.Linear(in_f, out_f, bias=bias is not None, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    fully_shard(lin, mesh=mesh or init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    return lin


# Empty shards: a 1-D mesh of 4 ranks over dims shorter than the mesh (torch.chunk gives the
# trailing ranks nothing). name -> (global shape, dtype); "fsdp.*" belong to an
# nn.Linear(12, 6) sharded by fully_shard, the others are distribute_tensor(..., [Shard(0)]).
EMPTY: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "e": ((3, 4), torch.float32),  # rows 1, 1, 1, 0
    "router": ((2,), torch.float32),  # 1, 1, 0, 0
    "fsdp.weight": ((6, 12), torch.bfloat16),  # 2, 2, 2, 0
    "fsdp.bias": ((6,), torch.bfloat16),  # 2, 2, 2, 0
}


def empty_shard_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return {n: torch.randn(s, generator=g).to(d) for n, (s, d) in EMPTY.items()}


def empty_shard_trainer_rank(rank: int, port: int, controller: str, results: Any) -> None:
    """Rank `rank` of 4: rank 3 holds only empty shards. Ranks 0 and 3 register through the
    DTensor adapter, ranks 1 and 2 pass their DTensors to register() directly."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from clients.dtensor_adapter import register_dtensor_module
    from refitd.client import TrainerClient

    trainer = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4
        )
        mesh = init_device_mesh("cpu", (4,))
        weights = empty_shard_weights()
        module = torch.nn.Module()
        for name in ("e", "router"):
            dt = distribute_tensor(weights[name], mesh, [Shard(0)])
            module.register_parameter(name, torch.nn.Parameter(dt))
        lin = _fsdp_linear(weights["fsdp.weight"], weights["fsdp.bias"], mesh)
        module.fsdp = lin
        shapes = {n: tuple(p.to_local().shape) for n, p in module.named_parameters()}
        trainer = TrainerClient(controller, "empty", rank=rank, pool_size=4, device=f"cpu:{rank}")
        if rank in (0, 3):
            register_dtensor_module(trainer, module)
        else:
            trainer.register(dict(module.named_parameters()))
        results.put((rank, "shapes", shapes))
        dist.barrier()
        results.put((rank, "v1", trainer.refit(1, wait="committed", timeout=60).state))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
