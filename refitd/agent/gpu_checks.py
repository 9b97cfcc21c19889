"""GPU data-plane checks, run by hand on a machine with a CUDA device (one session).

(a) `cuda_ipc_refit`: a trainer process and an inference process on cuda:0 hold a BF16 model
    (source split in two row shards per tensor, destination whole), registered through CUDA
    IPC handles; a transfer process maps both and runs the real executor (local transport,
    one slot). Reports GB/s (bytes read + written), the ratio to a device-to-device copy
    measured in the same transfer process, how long the trainer was held (until "sources
    released") against a device-local snapshot copy of its weights, and a bit-for-bit check.
(b) `nccl_self_transfer`: a world of one NCCL rank sends a program's messages to itself
    (batched send/recv in one NCCL group) through the real executor; GB/s and ratio to a
    device copy.

`python3 -m refitd.agent.gpu_checks [--quick] [--gib N]` prints one JSON line. Imports only
torch, numpy and msgpack (through refitd.plan / refitd.agent / refitd.transport).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import torch

from refitd.agent.direct_plan import direct_programs
from refitd.agent.executor import DirectResolver, Executor, ExecutorConfig
from refitd.agent.segments import ResolvedTensor
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.program import Message, SlotProgram, message_nbytes
from refitd.transport.memory import SharedTensorArena

COLS = 8192


def _model(total_bytes: int, tensor_bytes: int = 256 << 20) -> list[tuple[str, tuple[int, int]]]:
    n = max(1, round(total_bytes / tensor_bytes))
    rows = max(128, total_bytes // n // (COLS * 2) // 128 * 128)
    return [(f"layers.{k}.weight", (rows, COLS)) for k in range(n)]


def _pattern(k: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    n = math.prod(shape)
    x = torch.arange(n, dtype=torch.int32, device=device)
    return ((x * 7 + k * 13) % 2039 - 1019).to(torch.bfloat16).reshape(shape) / 64


def _specs(model: list[tuple[str, tuple[int, int]]]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    src, dst = [], []
    for name, (r, c) in model:
        half = r // 2
        for rank in range(2):
            box = Box((rank * half, 0), (half, c), (0, 0))
            src.append(
                TensorSpec(
                    "gpu", "trainer", rank, 0, name, name, (r, c), "bfloat16", (half, c), (box,)
                )
            )
        box = Box((0, 0), (r, c), (0, 0))
        dst.append(TensorSpec("gpu", "infer", 0, 0, name, name, (r, c), "bfloat16", (r, c), (box,)))
    return src, dst


def _worker(conn: Connection, role: str, total_bytes: int) -> None:
    """Trainer or inference process: allocate, register via CUDA IPC, serve requests."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = _model(total_bytes)
    src, dst = _specs(model)
    specs = src if role == "trainer" else dst
    tensors = []
    for s in specs:
        k = next(i for i, (n, _) in enumerate(model) if n == s.name)
        if role == "trainer":
            g = _pattern(k, s.global_shape, dev)
            b = s.boxes[0]
            tensors.append(g[b.offset[0] : b.offset[0] + b.shape[0]].clone())
            del g
        else:
            tensors.append(torch.zeros(s.local_shape, dtype=torch.bfloat16, device=dev))
    torch.cuda.synchronize()
    arena = SharedTensorArena(prefix=f"refitd-gpu-{role}")
    handles = arena.register({f"{role}{i}": t for i, t in enumerate(tensors)})
    conn.send([handles[f"{role}{i}"].to_bytes() for i in range(len(tensors))])
    while True:
        cmd = conn.recv()
        if cmd == "snapshot":
            torch.cuda.synchronize()
            t0 = time.monotonic()
            copies = [t.clone() for t in tensors]
            torch.cuda.synchronize()
            conn.send(time.monotonic() - t0)
            del copies
        elif cmd == "verify":
            ok = True
            for s, t in zip(specs, tensors, strict=True):
                k = next(i for i, (n, _) in enumerate(model) if n == s.name)
                ok = ok and bool(torch.equal(t, _pattern(k, s.global_shape, dev)))
            conn.send(ok)
        elif cmd == "close":
            arena.close()
            conn.send(True)
            return


def cuda_ipc_refit(total_bytes: int = 8 << 30, timeout_s: float = 300.0) -> dict:
    """(a) trainer -> inference on one GPU through a transfer process mapping CUDA IPC handles."""
    from refitd.agent.transfer_process import TransferProcessHandle

    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    for role in ("trainer", "infer"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, role, total_bytes), daemon=True)
        p.start()
        procs.append(p)
        conns[role] = parent
    handle = None
    try:
        mem = {}
        for role, conn in conns.items():
            if not conn.poll(timeout_s):
                raise TimeoutError(f"{role} process did not register within {timeout_s}s")
            mem[role] = conn.recv()
        src, dst = _specs(_model(total_bytes))
        (program,) = direct_programs(src, dst, digest="gpu-ipc").values()
        handles = {i: mem["trainer"][i] for i in range(len(src))}
        handles |= {len(src) + j: mem["infer"][j] for j in range(len(dst))}
        handle = TransferProcessHandle(0, device="cuda:0")
        handle.connect(1, "", 0, 0, 1, "local", 30.0)
        handle.load("gpu-ipc", program.to_bytes(), handles)
        nbytes = sum(math.prod(c.shape) * 2 for c in program.local)
        handle.execute("gpu-ipc", 1, 1, timeout_s)  # warm: maps the IPC handles
        held: list[float] = []
        t0 = time.monotonic()
        report = handle.execute(
            "gpu-ipc",
            2,
            2,
            timeout_s,
            on_sources_released=lambda: held.append(time.monotonic() - t0),
        )
        chunk = min(nbytes, 1 << 30)
        repeat = max(1, round(nbytes / chunk))
        handle.probe(timeout_s, memcpy=chunk, repeat=repeat, device="cuda:0", prepare=True).result(
            timeout_s
        )
        ref = handle.probe(timeout_s, memcpy=chunk, repeat=repeat, device="cuda:0").result(
            timeout_s
        )
        conns["trainer"].send("snapshot")
        snapshot_s = conns["trainer"].recv()
        conns["infer"].send("verify")
        verified = conns["infer"].recv()
        seconds = report["seconds"]
        return {
            "check": "cuda_ipc_refit",
            "bytes": nbytes,
            "seconds": round(seconds, 4),
            "gbps_rw": round(2 * nbytes / seconds / 1e9, 2),
            "ref_d2d_gbps_rw": round(2 * chunk * repeat / ref["seconds"] / 1e9, 2),
            "ratio": round((ref["seconds"] / (chunk * repeat)) / (seconds / nbytes), 3),
            "trainer_held_s": round(report["sources_released_s"], 4),
            "trainer_held_parent_s": round(held[0], 4) if held else None,
            "snapshot_copy_s": round(snapshot_s, 4),
            "verified": verified,
        }
    finally:
        if handle is not None:
            handle.close()
        for conn in conns.values():
            try:
                conn.send("close")
                conn.poll(30) and conn.recv()
            except (OSError, EOFError):
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def nccl_self_transfer(total_bytes: int = 4 << 30, timeout_s: float = 300.0) -> dict:
    """(b) one NCCL rank sends a program's messages to itself (grouped send/recv)."""
    import torch.distributed as dist

    from refitd.transport.base import ConnectInfo
    from refitd.transport.nccl import NcclTransport

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = _model(total_bytes)
    src, dst = _specs(model)
    tensors: dict[int, ResolvedTensor] = {}
    for i, s in enumerate(src):
        tensors[i] = ResolvedTensor(
            s.name, torch.full(s.local_shape, float(i % 7), dtype=torch.bfloat16, device=dev)
        )
    for j, d in enumerate(dst):
        tensors[len(src) + j] = ResolvedTensor(
            d.name, torch.zeros(d.local_shape, dtype=torch.bfloat16, device=dev)
        )
    (program,) = direct_programs(src, dst, digest="nccl-self", bucket_bytes=256 << 20).values()
    specs = program.tensors
    # each local copy becomes a message from slot 0 to slot 0
    msgs = [
        Message(mid, mid, 0, 0, (c,), message_nbytes((c,), specs))
        for mid, c in enumerate(program.local)
    ]
    program = SlotProgram("nccl-self", 0, specs, tuple(msgs), tuple(msgs), ())
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    transport = NcclTransport()
    transport.connect(ConnectInfo(1, "127.0.0.1", store.port, 0, 1, 60.0))
    try:
        ex = Executor(
            program, DirectResolver(tensors), transport, config=ExecutorConfig(), device=dev
        )
        ex.run(timeout_s)
        report = ex.run(timeout_s)
        nbytes = report.sent_bytes
        ok = all(
            torch.equal(tensors[len(src) + j].data[: d.local_shape[0] // 2], tensors[2 * j].data)
            and torch.equal(
                tensors[len(src) + j].data[d.local_shape[0] // 2 :], tensors[2 * j + 1].data
            )
            for j, d in enumerate(dst)
        )
        a = torch.ones(min(nbytes, 1 << 30), dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        b.copy_(a)
        torch.cuda.synchronize()
        ref_s = (time.monotonic() - t0) * nbytes / a.numel()
        return {
            "check": "nccl_self_transfer",
            "bytes": nbytes,
            "seconds": round(report.seconds, 4),
            "gbps": round(nbytes / report.seconds / 1e9, 2),
            "ref_d2d_gbps": round(nbytes / ref_s / 1e9, 2),
            "ratio": round(ref_s / report.seconds, 3),
            "zero_copy_chunks": sum(m.zero_copy_chunks for m in report.messages),
            "verified": ok,
        }
    finally:
        transport.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m refitd.agent.gpu_checks")
    parser.add_argument("--quick", action="store_true", help="1 GiB model instead of 8 GiB")
    parser.add_argument("--gib", type=float, default=None, help="model size in GiB")
    parser.add_argument("--only", choices=("ipc", "nccl"), default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    gib = args.gib if args.gib is not None else (1.0 if args.quick else 8.0)
    total = int(gib * (1 << 30))
    out: dict = {"device": torch.cuda.get_device_name(0), "model_bytes": total}
    for key, fn in (("ipc", cuda_ipc_refit), ("nccl", nccl_self_transfer)):
        if args.only not in (None, key):
            continue
        try:
            out[key] = fn(total)
        except Exception as e:  # report every check even if one fails
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))
    return 0 if all("error" not in v for v in out.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
