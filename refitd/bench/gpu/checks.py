"""Data-plane checks of one device, driven by `refitd bench gpu` (refitd/bench/gpu/command.py).

`ipc_refit`: a trainer process and an inference process on one device hold a BF16 model
(each source tensor split in two row shards, each destination whole), registered through
worker memory handles (CUDA IPC on a GPU, shared memory on the CPU); a transfer process maps
both and runs the real executor (local transport, one slot) on a plan from the real planner,
several refits in a row. Destination storage is plain BF16 or persistent quantized buffers
("mxfp8", "fp8_block": data + scales registered together, converted on landing; "nvfp4":
data + scales + global scale, each tensor landed whole, so the trainer holds it whole). Reports
the median refit time, GB/s (bytes read + written), the ratio to a memcpy of the same bytes
measured in the same transfer process, how long the trainer was held (until "sources
released") against a snapshot copy of its weights into preallocated buffers, that the
destination data pointers never changed, and a bit-for-bit check (quantized storage: equal
to refitd.formats' quantizer of the expected tensor, spot-checked against the CPU torch
reference: the first rows of every tensor, or for NVFP4, whose global scale is the whole
tensor's, the first tensor whole).

`nccl_self_transfer`: a world of one NCCL rank sends a program's messages to itself
(batched send/recv in one NCCL group) through the real executor; GB/s, ratio to a device
copy, bit-for-bit check. A real two-rank transfer needs two GPUs.

Imports only torch, numpy and msgpack (through refitd.plan / agent / transport / formats).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch

from refitd.executor.run import DirectResolver, Executor, ExecutorConfig
from refitd.executor.segments import ResolvedTensor
from refitd.memory.arena import SharedTensorArena
from refitd.memory.handles import MemoryHandle
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import Message, encode_program, message_nbytes, program_from_objects
from refitd.plan.wire import (
    FP8_BLOCK,
    MXFP8,
    NVFP4,
    PLAIN,
    fp8_block_scale_shape,
    mxfp8_scale_shape,
    nvfp4_data_shape,
    nvfp4_scale_shape,
    segment_parts,
)
from refitd.slot_protocol import Apply, Connect, Execute, Load, Probe

if TYPE_CHECKING:
    from refitd.node.process_handle import TransferProcessHandle

COLS = 8192
TENSOR_BYTES = 256 << 20  # each large tensor of a model
ROW_ALIGN = 256  # two row shards of whole 128-row FP8 tiles
SPOT_ROWS = 256  # rows per tensor checked against the CPU torch reference


def model_shapes(
    total_bytes: int, tensor_bytes: int = TENSOR_BYTES, cols: int = COLS
) -> list[tuple[str, tuple[int, int]]]:
    """(name, (rows, cols)) BF16 tensors adding up to about total_bytes."""
    n = max(1, round(total_bytes / tensor_bytes))
    rows = max(ROW_ALIGN, total_bytes // n // (cols * 2) // ROW_ALIGN * ROW_ALIGN)
    return [(f"layers.{k}.weight", (rows, cols)) for k in range(n)]


def small_model_shapes(
    count: int, lo: int = 64 << 10, hi: int = 1 << 20, cols: int = 256, seed: int = 5
) -> list[tuple[str, tuple[int, int]]]:
    """`count` BF16 tensors of lo..hi bytes (uniform in rows of `cols`), many small ones."""
    g = torch.Generator().manual_seed(seed)
    row = cols * 2
    rows = torch.randint(lo // row, hi // row + 1, (count,), generator=g).tolist()
    return [(f"small.{k}.weight", (r, cols)) for k, r in enumerate(rows)]


def model_for(key: tuple[str, int, int]) -> tuple[list[tuple[str, tuple[int, int]]], int]:
    """(model, source shards per tensor) of ("big", total bytes, bytes per tensor) or
    ("small", count, 0)."""
    kind, n, tensor_bytes = key
    if kind == "small":
        return small_model_shapes(n), 1
    return model_shapes(n, tensor_bytes), 2


def pattern(k: int, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Global tensor k: distinct, exactly representable BF16 values from its index."""
    n = math.prod(shape)
    x = torch.arange(n, dtype=torch.int32, device=device)
    return ((x * 7 + k * 13) % 2039 - 1019).to(torch.bfloat16).reshape(shape) / 64


def model_specs(
    model: list[tuple[str, tuple[int, int]]], storage: str = PLAIN, split: int = 2
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Sources: `split` row shards per tensor (trainer ranks 0..split-1; one for NVFP4,
    whose destinations are landed whole); destinations: whole tensors (inference rank 0) in
    `storage`; everything on slot 0."""
    split = 1 if storage == NVFP4 else split
    src, dst = [], []
    for name, (r, c) in model:
        half = r // split
        for rank in range(split):
            box = Box((rank * half, 0), (half, c), (0, 0))
            src.append(
                TensorSpec(
                    "gpu", "trainer", rank, 0, name, name, (r, c), "bfloat16", (half, c), (box,)
                )
            )
        box = Box((0, 0), (r, c), (0, 0))
        dst.append(
            TensorSpec(
                "gpu", "infer", 0, 0, name, name, (r, c), "bfloat16", (r, c), (box,), storage
            )
        )
    return src, dst


def destination_buffers(spec: TensorSpec, device: torch.device) -> list[torch.Tensor]:
    """The persistent buffers of a destination tensor: [data], [data, scales] or (nvfp4)
    [data, scales, global scale]."""
    shape = spec.local_shape
    if spec.storage == PLAIN:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device)]
    if spec.storage == MXFP8:
        scales = torch.zeros(mxfp8_scale_shape(shape), dtype=torch.uint8, device=device)
        return [torch.zeros(shape, dtype=torch.uint8, device=device), scales]
    if spec.storage == FP8_BLOCK:
        scales = torch.zeros(fp8_block_scale_shape(shape), dtype=torch.float32, device=device)
        return [torch.zeros(shape, dtype=torch.uint8, device=device), scales]
    if spec.storage == NVFP4:
        return [
            torch.zeros(nvfp4_data_shape(shape), dtype=torch.uint8, device=device),
            torch.zeros(nvfp4_scale_shape(shape), dtype=torch.uint8, device=device),
            torch.zeros(1, dtype=torch.float32, device=device),
        ]
    raise ValueError(f"unknown storage {spec.storage!r}")


def _stored_bytes(spec: TensorSpec) -> int:
    """Bytes of a destination tensor's buffers (the parts of its storage's wire format)."""
    if spec.storage == PLAIN:
        return 2 * math.prod(spec.local_shape)
    return sum(segment_parts(spec.storage, spec.local_shape, spec.dtype))


def quantized_reference(storage: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The buffers `storage` must hold for x, from refitd.formats' quantizer."""
    from refitd.formats import fp8_block_quantize, mxfp8_quantize, nvfp4_quantize

    quantize = {MXFP8: mxfp8_quantize, FP8_BLOCK: fp8_block_quantize, NVFP4: nvfp4_quantize}
    return quantize[storage](x)


def cpu_reference(storage: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The CPU torch reference buffers of x."""
    from refitd.formats import fp8_block, mxfp8, nvfp4

    ref = {MXFP8: mxfp8._reference_codes, FP8_BLOCK: fp8_block._reference_codes}
    return ref.get(storage, nvfp4._reference)(x.cpu())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:  # compare scale bits (NaN-safe)
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))


def _worker(
    conn: Connection, role: str, model_key: tuple[str, int, int], device: str, storage: str
) -> None:
    """Trainer or inference process: allocate, register, then serve commands:
    ("fill", seed) (trainer: new weights), "snapshot", ("verify", seed), "close"."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model, split = model_for(model_key)
    src, dst = model_specs(model, storage, split)
    index = {name: k for k, (name, _) in enumerate(model)}
    specs = src if role == "trainer" else dst
    buffers = [
        [torch.empty(s.local_shape, dtype=torch.bfloat16, device=dev)]
        if role == "trainer"
        else destination_buffers(s, dev)
        for s in specs
    ]
    tensors = [b[0] for b in buffers]
    arena = SharedTensorArena(prefix=f"refitd-gpu-{role}")
    names = ("t", "s", "g")  # data, scales, global scale
    handles = arena.register(
        {f"{names[k]}{i}": t for i, b in enumerate(buffers) for k, t in enumerate(b)}
    )
    out: list[bytes] = []
    for i in range(len(tensors)):
        h: MemoryHandle = handles[f"t{i}"]
        h = dataclasses.replace(h, scales=handles.get(f"s{i}"), global_scale=handles.get(f"g{i}"))
        out.append(h.to_bytes())
    # the registered tensors' addresses (shared memory moved CPU storage once, above)
    ptrs = _addresses(buffers)
    conn.send(out)
    snap = [torch.empty_like(t) for t in tensors] if role == "trainer" else []
    while True:
        cmd = conn.recv()
        op, arg = cmd if isinstance(cmd, tuple) else (cmd, None)
        if op == "fill":
            for s, t in zip(specs, tensors, strict=True):
                b = s.boxes[0]
                g = pattern(index[s.name] + arg, s.global_shape, dev)
                t.copy_(g[b.offset[0] : b.offset[0] + b.shape[0]])
                del g
            if dev.type == "cuda":
                torch.cuda.synchronize()
            conn.send(True)
        elif op == "snapshot":  # copy of the weights into preallocated buffers, 3 times
            times = []
            for _ in range(3):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.monotonic()
                for a, t in zip(snap, tensors, strict=True):
                    a.copy_(t)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.monotonic() - t0)
            conn.send(statistics.median(times))
        elif op == "verify":
            conn.send(_verify(specs, buffers, ptrs, index, arg, dev))
        elif op == "close":
            arena.close()
            conn.send(True)
            return


def _addresses(buffers: list[list[torch.Tensor]]) -> list[list[int]]:
    return [[t.data_ptr() for t in b] for b in buffers]


def _verify(specs, buffers, ptrs, index, seed, dev) -> dict:
    """Bit-for-bit check of the destination buffers, and that their addresses held."""
    ok, spot = True, True
    for k, (s, bufs) in enumerate(zip(specs, buffers, strict=True)):
        want = pattern(index[s.name] + seed, s.global_shape, dev)
        if s.storage == PLAIN:
            ok = ok and bool(torch.equal(bufs[0], want))
            continue
        expect = quantized_reference(s.storage, want)
        ok = ok and all(_same(b, w) for b, w in zip(bufs, expect, strict=True))
        if s.storage == NVFP4:  # its global scale is the whole tensor's: one tensor, whole
            if k == 0:
                spot = all(
                    _same(b.cpu(), w) for b, w in zip(bufs, cpu_reference(NVFP4, want), strict=True)
                )
            continue
        rows = min(SPOT_ROWS, want.shape[0])
        cdata, csc = cpu_reference(s.storage, want[:rows])
        srows = csc.shape[0]
        data, sc = bufs
        spot = spot and _same(data[:rows].cpu(), cdata) and _same(sc[:srows].cpu(), csc)
    same_ptrs = ptrs == _addresses(buffers)
    return {"verified": ok, "cpu_reference_spot_check": spot, "data_ptrs_unchanged": same_ptrs}


def ipc_refit(
    total_bytes: int = 8 << 30,
    device: str = "cuda:0",
    storage: str = PLAIN,
    refits: int = 5,
    timeout_s: float = 300.0,
    *,
    staged: bool = False,
    verify: bool = False,
    small: int = 0,
    snapshot: bool = False,
    tensor_bytes: int = TENSOR_BYTES,
) -> dict:
    """Trainer -> inference on one device through a transfer process mapping worker memory;
    `refits` timed refits, each of new weights (two versions alternate), median reported.

    staged: the destinations are a staged pool's (the refit lands in the transfer process's
    staging buffers, then `apply` copies them in place; both are timed). verify: after the
    plain refits, as many refits with checksum verification, timed the same way
    (verify_cost = their median over the plain median). small: a model of that many
    64 KiB-1 MiB tensors per rank instead of total_bytes in large tensors. snapshot: the
    trainer's sources are copied into the slot's snapshot (device memory where it fits)
    before the trainer is released, and the refit reads the snapshot. tensor_bytes: the
    size of each large tensor (an MoE expert's is tens of MiB, a dense layer's hundreds).
    """
    from refitd.node.process_handle import TransferProcessHandle

    model_key = ("small", small, 0) if small else ("big", total_bytes, tensor_bytes)
    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    for role in ("trainer", "infer"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, role, model_key, device, storage), daemon=True)
        p.start()
        procs.append(p)
        conns[role] = parent

    def ask(role: str, cmd: object) -> object:
        conns[role].send(cmd)
        if not conns[role].poll(timeout_s):
            raise TimeoutError(f"{role} process did not answer {cmd!r} within {timeout_s}s")
        return conns[role].recv()

    handle = None
    try:
        mem = {}
        for role, conn in conns.items():
            if not conn.poll(timeout_s):
                raise TimeoutError(f"{role} process did not register within {timeout_s}s")
            mem[role] = conn.recv()
        model, split = model_for(model_key)
        src, dst = model_specs(model, storage, split)
        plan = build_plan("gpu", 1, src, dst, PlanConfig())
        program = plan.program(0)
        handles = {i: mem["trainer"][i] for i in range(len(src))}
        handles |= {len(src) + j: mem["infer"][j] for j in range(len(dst))}
        handle = TransferProcessHandle(0, device=device if device.startswith("cuda") else None)
        handle.send(Connect(1, "", 0, 0, 1, "local", 30.0)).result()
        stage = tuple(len(src) + j for j in range(len(dst))) if staged else ()
        snap = tuple(range(len(src))) if snapshot else ()
        load = Load(plan.digest, encode_program(program), handles, staged=stage, snapshot=snap)
        if snapshot:
            load = dataclasses.replace(load, snapshot_bytes=2 * total_bytes)
        loaded = handle.send(load).result()
        nbytes = sum(math.prod(c.shape) * 2 for c in program.local)
        rw_bytes = nbytes + sum(_stored_bytes(d) for d in dst)  # BF16 read + buffers written
        ask("trainer", ("fill", 7))
        handle.send(Execute(plan.digest, 1, 1, timeout_s)).result()  # warm: maps the handles
        if staged:
            handle.send(Apply(plan.digest, 1, timeout_s)).result()
        run = _Runs(handle, plan.digest, ask, staged, timeout_s, device)
        plain = run.timed(refits, first_id=2, verify=False)
        checked = run.timed(refits, first_id=2 + refits, verify=True) if verify else None
        ref = _memcpy_seconds(handle, nbytes, device, timeout_s)
        snapshot_s = float(ask("trainer", "snapshot"))  # type: ignore[arg-type]
        check = ask("infer", ("verify", run.seed))
        seconds = plain["seconds"]
        out = {
            "check": "ipc_refit",
            "device": device,
            "storage": storage,
            "tensors": len(model),
            "tensor_shape": list(model[0][1]),
            "source_shards": len(src),
            "staged": staged,
            "bytes": nbytes,
            "refits": refits,
            **plain,
            "rw_bytes": rw_bytes,
            "gbps_rw": round(rw_bytes / seconds / 1e9, 2),
            "ref_memcpy_gbps_rw": round(2 * nbytes / ref / 1e9, 2),
            # memcpy time of the same read + written bytes over the refit's time
            "ratio": round(ref * rw_bytes / (2 * nbytes) / seconds, 3),
            "snapshot_copy_s": round(snapshot_s, 6),
            "held_over_snapshot": round(plain["trainer_held_s"] / snapshot_s, 3)
            if snapshot_s
            else None,
            **check,  # type: ignore[dict-item]
        }
        if snapshot:
            out["snapshot"] = (
                None if loaded.snapshot is None else dataclasses.asdict(loaded.snapshot)
            )
        if checked is not None:
            out["verified_refits"] = checked
            out["verify_cost"] = round(checked["seconds"] / seconds, 3)
        return out
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


@dataclasses.dataclass
class _Runs:
    """Timed refits of one loaded plan (new weights each time, two versions alternating)."""

    handle: TransferProcessHandle
    digest: str
    ask: object
    staged: bool
    timeout_s: float
    device: str
    seed: int = 0

    def timed(self, refits: int, first_id: int, verify: bool) -> dict:
        """Medians of `refits` refits: seconds (execute, plus apply when staged), parent
        wall time, trainer held time, phases."""
        reports, walls, held, applies = [], [], [], []
        for k in range(refits):
            self.seed = 1000 * (k % 2)
            self.ask("trainer", ("fill", self.seed))  # type: ignore[operator]
            got: list[float] = []
            rid = first_id + k
            t0 = time.monotonic()
            execute = Execute(self.digest, rid, rid, self.timeout_s, verify=verify)
            executed = self.handle.send(execute).result(
                lambda _, g=got, t=t0: g.append(time.monotonic() - t)
            )
            reports.append(executed.report)
            if self.staged:
                apply = Apply(self.digest, rid, self.timeout_s)
                applies.append(self.handle.send(apply).result().seconds)
            walls.append(time.monotonic() - t0)
            held += got
        execs = [r.seconds for r in reports]
        totals = [e + a for e, a in zip(execs, applies or [0.0] * refits, strict=True)]
        work = "local_launch_s" if self.device == "cpu" else "local_gpu_s"
        out = {
            "seconds": round(statistics.median(totals), 6),
            "seconds_all": [round(t, 6) for t in totals],
            "parent_wall_s": round(statistics.median(walls), 6),
            "trainer_held_s": round(statistics.median(r.sources_released_s for r in reports), 6),
            "trainer_held_parent_s": round(statistics.median(held), 6) if held else None,
            "phases": {
                k: round(statistics.median(r.phases.get(k, 0.0) for r in reports), 6)
                for k in reports[-1].phases
            },
            "host_us": _host_split(reports, walls, work),
            "landing_tiles": reports[-1].tiles,  # what the landing's own tuner picked
        }
        if self.staged:
            out["execute_s"] = round(statistics.median(execs), 6)
            out["apply_s"] = round(statistics.median(applies), 6)
        return out


def _host_split(reports: list, walls: list[float], work: str) -> dict[str, float]:
    """Medians over the refits, in microseconds, of the transfer process's fixed host time
    per refit: `fixed` is the refit's time less the landing work (`work`: the GPU time of
    the local copies, or on a CPU device the calls that do them), split into the storage
    check, the rest of the start (execution state, threads), the launch (GPU: the calls
    that queue the work), the wait for the GPU beyond its work, and the report (everything
    after the local copies); `command` is the execute command's own overhead around the
    refit, `reply` the parent's wall time beyond the command (pipe and pickling)."""
    rows = []
    for r, wall in zip(reports, walls, strict=True):
        p = r.phases
        local = p.get("local_s", 0.0)
        launch = 0.0 if work == "local_launch_s" else p.get("local_launch_s", 0.0)
        rows.append({
            "fixed": r.seconds - p.get(work, 0.0),
            "check": p.get("check_s", 0.0),
            "start": p.get("check_start_s", 0.0) - p.get("check_s", 0.0),
            "launch": launch,
            "wait": max(0.0, p.get("local_sync_s", 0.0) - p.get("local_gpu_s", 0.0)),
            "local_other": local - p.get("local_launch_s", 0.0) - p.get("local_sync_s", 0.0),
            "report": r.seconds - p.get("check_start_s", 0.0) - local,
            "command": p.get("command_s", r.seconds) - r.seconds,
            "reply": wall - p.get("command_s", r.seconds),
        })  # fmt: skip
    return {k: round(statistics.median(x[k] for x in rows) * 1e6, 1) for k in rows[0]}


def _memcpy_seconds(
    handle: TransferProcessHandle, nbytes: int, device: str, timeout_s: float
) -> float:
    """Median of 3 memcpys of nbytes (in chunks of at most 1 GiB) in the transfer process."""
    chunk = min(nbytes, 1 << 30)
    repeat = max(1, round(nbytes / chunk))
    dev = device if device.startswith("cuda") else "cpu"
    times = []
    probe = Probe(timeout_s, memcpy=chunk, repeat=repeat, device=dev)
    for _ in range(3):
        handle.send(dataclasses.replace(probe, prepare=True)).result()
        times.append(handle.send(probe).result().seconds)
    handle.send(Probe(timeout_s, release=True)).result()
    return statistics.median(times) * nbytes / (chunk * repeat)


def nccl_self_transfer(total_bytes: int = 4 << 30, timeout_s: float = 300.0) -> dict:
    """One NCCL rank sends a program's messages to itself (grouped send/recv)."""
    import torch.distributed as dist

    from refitd.transport.base import ConnectInfo
    from refitd.transport.nccl import NcclTransport

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = model_shapes(total_bytes)
    src, dst = model_specs(model)
    tensors: dict[int, ResolvedTensor] = {}
    for i, s in enumerate(src):
        tensors[i] = ResolvedTensor(s.name, pattern(i, s.local_shape, dev))
    for j, d in enumerate(dst):
        tensors[len(src) + j] = ResolvedTensor(
            d.name, torch.zeros(d.local_shape, dtype=torch.bfloat16, device=dev)
        )
    plan = build_plan("nccl-self", 1, src, dst, PlanConfig(bucket_bytes=256 << 20))
    local = plan.program(0)
    specs = local.tensors
    # each local copy becomes a message from slot 0 to slot 0
    msgs = [
        Message(mid, mid, 0, 0, (c,), message_nbytes((c,), specs))
        for mid, c in enumerate(local.local)
    ]
    program = program_from_objects(plan.digest, 0, specs, tuple(msgs), tuple(msgs), ())
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
        runs = [ex.run(timeout_s) for _ in range(3)]
        report = min(runs, key=lambda r: r.seconds)
        nbytes = report.sent_bytes
        ok = True
        for c in local.local:
            got = tensors[c.dst_tensor].data[
                tuple(slice(o, o + n) for o, n in zip(c.dst_offset, c.shape, strict=True))
            ]
            want = tensors[c.src_tensor].data[
                tuple(slice(o, o + n) for o, n in zip(c.src_offset, c.shape, strict=True))
            ]
            ok = ok and bool(torch.equal(got, want))
        a = torch.ones(min(nbytes, 1 << 30), dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            b.copy_(a)
            torch.cuda.synchronize()
            times.append(time.monotonic() - t0)
        ref_s = min(times) * nbytes / a.numel()
        return {
            "check": "nccl_self_transfer",
            "bytes": nbytes,
            "seconds": round(report.seconds, 6),
            "gbps": round(nbytes / report.seconds / 1e9, 2),
            "ref_d2d_gbps": round(nbytes / ref_s / 1e9, 2),
            "ratio": round(ref_s / report.seconds, 3),
            "messages": len(msgs),
            "zero_copy_chunks": sum(m.zero_copy_chunks for m in report.messages),
            "verified": ok,
            "note": "one GPU: a rank sending to itself; two ranks need two GPUs",
        }
    finally:
        transport.close()
