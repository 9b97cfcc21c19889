"""FSDP2 trainer ranks (2 Gloo processes, run spawned) that register their module at a given
point of its life, train on after registration, refit, and report what they then hold.

Scenarios: "fresh" registers right after fully_shard (FSDP2 re-pads uneven shards at its
first forward), "eval" after an eval forward (FSDP2 leaves the root's parameters unsharded),
"train" after a training step, "compiled" after a training step of a model whose layers run
under torch.compile. In "eval", rank 1 passes the module to `register()` itself (no
adapter). After registration every rank takes one more optimizer step, refits version 1,
runs a forward and reports its logits and FSDP2's own full_tensor() of every parameter,
serialized with torch.save."""

from __future__ import annotations

import io
import traceback
from typing import Any

import torch

VOCAB, HIDDEN = 15, 6  # 15 rows over 2 ranks: FSDP2 pads the uneven shards (8, 7)
TOKENS = torch.tensor([[1, 2, 3, 14, 7, 0]])
SCENARIOS = ("fresh", "eval", "train", "compiled")


class TinyLm(torch.nn.Module):
    """Embedding, two residual tanh layers, RMSNorm and an LM head: the root module holds
    embed_tokens, norm and lm_head, as in a transformers causal LM under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.lm_head(self.norm(h))


def global_shapes() -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in TinyLm().named_parameters()}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(TOKENS).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def fsdp_trainer_rank(rank: int, port: int, controller: str, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from clients.dtensor_adapter import canonical_dtensor_name, register_dtensor_module
    from refitd.client import TrainerClient

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        for scenario in SCENARIOS:
            torch.manual_seed(0)
            model = TinyLm()
            for i, layer in enumerate(model.layers):
                fully_shard(layer, mesh=mesh)
                if scenario == "compiled":
                    model.layers[i] = torch.compile(layer, backend="aot_eager")
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
            if scenario == "eval":
                with torch.no_grad():
                    model.eval()(TOKENS)
                model.train()
            elif scenario != "fresh":
                _step(model, opt)
            with TrainerClient(
                controller, f"fsdp-{scenario}", rank=rank, pool_size=2, device=f"cpu:{rank}"
            ) as trainer:
                if scenario == "eval" and rank == 1:
                    trainer.register(model)  # the client's own module path, no adapter
                else:
                    register_dtensor_module(trainer, model)
                _step(model, opt)  # training goes on in the registered memory
                dist.barrier()
                state = trainer.refit(1, wait="committed", timeout=60).state
                with torch.no_grad():
                    logits = model(TOKENS)  # the trainer's next forward
                model.reshard()
                full = {
                    canonical_dtensor_name(n): p.full_tensor() for n, p in model.named_parameters()
                }
                dist.barrier()
            results.put((rank, scenario, state, _dumps({"logits": logits, "full": full})))
    except BaseException:
        results.put((rank, "error", "", traceback.format_exc().encode()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
