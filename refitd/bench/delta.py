"""`refitd bench delta`: delta refits against dense refits of the same versions, same run.

Four spawned processes over Gloo (2 source slots -> 2 destination slots, loopback or the
address given): `--bytes` of BF16 weights in tensors of 4096 columns, split by rows on the
sources and by columns on the destinations (every source sends to every destination). Each
source slot keeps FP32 master weights and moves them by +-lr per element per version (Adam's
normalised step), publishing BF16 (or, with --density, gives that fraction of elements new
values); the density is measured, not assumed. Per version, a delta refit (capture of the
pending segments, encode, header + payload exchange, apply in place:
refitd.executor.delta.exchange) runs first, then a dense refit of the same version through
the executor; the destinations after both must be equal bit for bit (`verified`). Whether a version goes
through the delta path at all is the controller's refit-level choice (refit_mode: after a
measured density above --max-density the next versions go dense through the executor;
`picked`). Times are the slowest rank's from a common barrier; medians over versions. One
JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from refitd.plan.layout import Box, TensorSpec
from refitd.plan.planner import PlanConfig, build_plan
from refitd.plan.program import SlotProgram
from refitd.server.delta.policy import DeltaSettings, Timing, refit_mode

COLS = 4096
UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "": 1}


def parse_bytes(text: str) -> int:
    """'1GiB', '256m', '4096' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in "kmg" else ""
    return int(float(t[: len(t) - len(unit)]) * UNITS[unit])


SRC, DST = (0, 1), (2, 3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--tensor-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--density", type=float, default=None, help="force this density")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--max-density", type=float, default=0.4)
    parser.add_argument("--probe-every", type=int, default=8)
    parser.add_argument(
        "--no-speed-rule",
        action="store_true",
        help="ignore measured refit times (refit_mode's slower-than-dense rule): measures the codec",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank: the delta codec encodes and applies with as many",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of the Gloo store")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--link-bit",
        type=float,
        default=None,
        help="run the ranks on emulated hosts whose links are shaped to this rate (bit/s; root)",
    )


def specs(total: int, tensor_bytes: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Tensors of COLS BF16 columns: sources split by rows, destinations by columns."""
    rows = max(2, tensor_bytes // (2 * COLS))
    count = max(1, total // (rows * COLS * 2))
    src, dst = [], []
    for t in range(count):
        shape = (rows, COLS)
        for r in range(2):
            h, w = rows // 2 + (r < rows % 2), COLS // 2
            ro = r * (rows // 2) + min(r, rows % 2)
            box = Box((ro, 0), (h, COLS), (0, 0))
            src.append(TensorSpec("m", "train", r, SRC[r], f"w{t}", f"w{t}", shape,
                                  "bfloat16", (h, COLS), (box,)))  # fmt: skip
            box = Box((0, r * w), (rows, w), (0, 0))
            dst.append(TensorSpec("m", "infer", r, DST[r], f"w{t}", f"w{t}", shape,
                                  "bfloat16", (rows, w), (box,)))  # fmt: skip
    return src, dst


def _barrier(store: dist.TCPStore, name: str, rank: int, timeout_s: float) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(4)], datetime.timedelta(seconds=timeout_s))


@dataclasses.dataclass
class _Slot:
    """One slot of the bench, connected: its store, transport, executor for dense refits,
    delta access and sender base, and (on sources) the generator of its versions."""

    store: dist.TCPStore
    transport: Any
    executor: Any
    access: Any
    base: Any
    sends: list
    recvs: list
    flat: torch.Tensor
    gen: Any


def _open_slot(
    rank: int, port: int, args: argparse.Namespace, store_host: str | None, local: str
) -> _Slot:
    """Build the plan, lay the slot's tensors out, connect Gloo and warm both paths up with
    version 0 (dense), the base promoted to it."""
    from refitd.demo.versions import VersionGenerator
    from refitd.executor.delta.access import ProgramAccess
    from refitd.executor.delta.exchange import DeltaBase, exchange_deltas
    from refitd.executor.run import DirectResolver, Executor
    from refitd.transport.base import ConnectInfo
    from refitd.transport.gloo import GlooTransport

    src, dst = specs(args.bytes, args.tensor_bytes)
    program = build_plan("m", 1, src, dst, PlanConfig(64 << 20)).program(rank)
    flat, tensors = _slot_tensors(program, rank)
    gen = VersionGenerator(flat.numel(), args.lr, seed=rank) if rank in SRC else None
    if gen is not None:
        gen.current(flat)
    host = store_host or args.host
    timeout = datetime.timedelta(seconds=args.timeout)
    master = store_host is not None and rank == 0
    store = dist.TCPStore(host, port, 4, master, timeout, wait_for_workers=False)
    t = GlooTransport()
    t.connect(ConnectInfo(0, host, port, rank, 4, args.timeout, local_address=local))
    ex = Executor(program, DirectResolver(tensors), t)
    access = ProgramAccess(program, lambda i: tensors[i], lambda s: s)
    base = DeltaBase()
    sends, recvs = access.messages("send", access.sends), access.messages("recv", access.recvs)
    ex.run(args.timeout)  # version 0 dense, warms the executor
    exchange_deltas(t, sends, recvs, access, base, 0, allowed=frozenset(), max_density=0.0,
              deadline=time.monotonic() + args.timeout)  # fmt: skip
    base.promote(0, access)
    return _Slot(store, t, ex, access, base, sends, recvs, flat, gen)


def _rank(
    rank: int,
    port: int,
    args: argparse.Namespace,
    out: mp.Queue | _Printer,
    store_host: str | None = None,
    local: str = "",
) -> None:
    """One slot: dense refits through the executor, delta refits through the exchange. With
    store_host, rank 0 serves the store there (the ranks in their own namespaces)."""
    from refitd.demo.versions import perturb
    from refitd.executor.delta.exchange import KIND_DELTA, DeltaReport, exchange_deltas

    torch.set_num_threads(args.threads)
    slot = _open_slot(rank, port, args, store_host, local)
    store, t, ex, access, base = slot.store, slot.transport, slot.executor, slot.access, slot.base
    sends, recvs, flat, gen = slot.sends, slot.recvs, slot.flat, slot.gen
    policy = DeltaSettings(True, args.max_density, args.probe_every)
    densities: list[float | None] = []
    timings: list[Timing] = []
    for v in range(1, args.versions + 1):
        if gen is not None and args.density is None:  # a source publishes version v
            gen.step(flat)
        elif gen is not None:
            perturb(flat, args.density, seed=v * 10 + rank)
        # the controller's refit-level choice
        mode = refit_mode(policy, densities, () if args.no_speed_rule else timings)
        use_delta = mode.delta
        _barrier(store, f"delta{v}", rank, args.timeout)
        t0 = time.monotonic()
        promote_s = 0.0
        if use_delta:  # as in the daemon, the execute first promotes the version committed last
            base.promote(v - 1, access)
            promote_s = time.monotonic() - t0
            rep = exchange_deltas(t, sends, recvs, access, base, v, allowed=frozenset(access.sends),
                            max_density=args.max_density, deadline=t0 + args.timeout)  # fmt: skip
        else:
            rep = DeltaReport()
            ex.run(args.timeout)
        delta_s = time.monotonic() - t0
        got = flat.clone() if rank in DST else None
        _barrier(store, f"dense{v}", rank, args.timeout)
        t0 = time.monotonic()
        report = ex.run(args.timeout)
        dense_s = time.monotonic() - t0
        verified = got is None or torch.equal(got.view(torch.int16), flat.view(torch.int16))
        if not use_delta:  # no pending version: the base is forgotten, as in the daemon
            base.promote(v, access)
        sent = list(rep.sent.values())
        changed = sum(m["changed"] for m in sent)
        elements = sum(m["elements"] for m in sent)
        ndelta = sum(m["kind"] == KIND_DELTA for m in sent)
        density, slow_delta, slow_dense, any_delta = _exchange_outcome(
            store, v, rank, (changed, elements, ndelta), (delta_s, dense_s)
        )
        densities.append(density)
        if use_delta:  # the controller times every refit: here the dense one of v, then v's
            timings += [Timing(False, slow_dense), Timing(any_delta, slow_delta)]
        else:
            timings.append(Timing(False, min(slow_delta, slow_dense)))
        out.put({"rank": rank, "version": v, "delta_s": delta_s, "dense_s": dense_s,
                 "encode_s": rep.encode_s, "apply_s": rep.apply_s, "promote_s": promote_s,
                 "verified": verified,
                 "wire_bytes": rep.wire_bytes if use_delta else report.sent_bytes,
                 "dense_bytes": report.sent_bytes, "changed": changed, "elements": elements,
                 "picked": "delta" if use_delta else "dense", "why": mode.why.name.lower(),
                 "delta_messages": ndelta,
                 "messages": len(sent), "base_bytes": base.nbytes})  # fmt: skip
    _barrier(store, "end", rank, args.timeout)
    t.close()


def _slot_tensors(program: SlotProgram, rank: int) -> tuple[torch.Tensor, dict]:
    """The rank's tensors of the program as views of one flat bf16 buffer (zeros)."""
    from refitd.executor.segments import ResolvedTensor

    mine = {i: s for i, s in program.tensors.items() if s.slot == rank}
    flat = torch.zeros(sum(s.local_shape[0] * s.local_shape[1] for s in mine.values()),
                       dtype=torch.bfloat16)  # fmt: skip
    tensors, at = {}, 0
    for i, s in sorted(mine.items()):
        n = s.local_shape[0] * s.local_shape[1]
        tensors[i] = ResolvedTensor(f"tensor {i}", flat[at : at + n].view(s.local_shape))
        at += n
    return flat, tensors


def _exchange_outcome(
    store: dist.TCPStore,
    v: int,
    rank: int,
    counts: tuple[int, int, int],
    seconds: tuple[float, float],
) -> tuple[float | None, float, float, bool]:
    """Every rank's view of version v, through the store: the sources' changed-element
    density, the slowest rank's delta and dense seconds, and whether any message went as
    a delta. `counts`: this rank's (changed, elements, delta messages)."""
    if rank in SRC:
        store.set(f"density{v}/{rank}", " ".join(map(str, counts)))
    store.set(f"seconds{v}/{rank}", f"{seconds[0]} {seconds[1]}")
    both = [store.get(f"density{v}/{r}").decode().split() for r in SRC]
    c, e = sum(int(x[0]) for x in both), sum(int(x[1]) for x in both)
    secs = [[float(x) for x in store.get(f"seconds{v}/{r}").decode().split()] for r in range(4)]
    return (
        c / e if e else None,
        max(x[0] for x in secs),
        max(x[1] for x in secs),
        sum(int(x[2]) for x in both) > 0,
    )


def _summary(rows: list[dict], args: argparse.Namespace, load: tuple[float, ...]) -> dict:
    per_v: dict[int, list[dict]] = {}
    for r in rows:
        per_v.setdefault(r["version"], []).append(r)
    secs = [max(r["delta_s"] for r in rs) for rs in per_v.values()]
    dense = [max(r["dense_s"] for r in rs) for rs in per_v.values()]
    src = [r for r in rows if r["rank"] in SRC]
    n = len(per_v)
    wire = sum(r["wire_bytes"] for r in src) / n
    dense_wire = sum(r["dense_bytes"] for r in src) / n
    changed, elements = sum(r["changed"] for r in src), sum(r["elements"] for r in src)
    # wire bytes of the versions that were measured (went through the delta path)
    med, dmed = statistics.median(secs), statistics.median(dense)
    return {
        "bench": "delta",
        # the machine's load average (1, 5, 15 min) at the start and at the end
        "load_avg": [[round(x, 2) for x in load], [round(x, 2) for x in os.getloadavg()]],
        "transport": "gloo",
        "link_bit": args.link_bit,
        "bytes": args.bytes,
        "lr": None if args.density is not None else args.lr,
        "forced_density": args.density,
        "versions": n,
        "threads": args.threads,
        "picked": [
            next(r["picked"] for r in per_v[v] if r["rank"] == SRC[0]) for v in sorted(per_v)
        ],
        "why": [next(r["why"] for r in per_v[v] if r["rank"] == SRC[0]) for v in sorted(per_v)],
        "density": changed / elements if elements else None,
        "delta_messages": sum(r["delta_messages"] for r in src),
        "messages": sum(r["messages"] for r in src),
        "wire_bytes": int(wire),
        "dense_wire_bytes": int(dense_wire),
        "wire_ratio": wire / dense_wire if dense_wire else None,
        "seconds_per_version": [round(x, 4) for x in secs],
        "dense_seconds_per_version": [round(x, 4) for x in dense],
        "seconds": med,
        "dense_seconds": dmed,
        "time_ratio": med / dmed if dmed else None,
        **_delta_versions(per_v),
        "base_memory_bytes": max(r["base_bytes"] for r in src) * len(SRC),
        "verified": all(r["verified"] for r in rows),
    }


def _delta_versions(per_v: dict[int, list[dict]]) -> dict:
    """The versions that went through the delta path: codec times, their own wire and time
    ratios (the choice of dense aside)."""
    vs = [rs for rs in per_v.values() if rs[0]["picked"] == "delta"]
    if not vs:
        return {"delta_versions": 0, "encode_s": None, "apply_s": None}
    src = [r for rs in vs for r in rs if r["rank"] in SRC]
    secs = statistics.median(max(r["delta_s"] for r in rs) for rs in vs)
    dense = statistics.median(max(r["dense_s"] for r in rs) for rs in vs)

    def slowest(key: str, ranks: tuple[int, ...]) -> float:
        return statistics.median(max(r[key] for r in rs if r["rank"] in ranks) for rs in vs)

    encode, apply = slowest("encode_s", SRC), slowest("apply_s", DST)
    # the slots encode (and apply) in parallel: a refit's dense bytes over the slowest slot's
    # seconds, against the same bytes over the dense refit's seconds (the link)
    nbytes = sum(r["dense_bytes"] for r in src) / len(vs)
    gbps = {k: nbytes / s / 1e9 if s else None for k, s in (("encode", encode),
            ("apply", apply), ("link", dense))}  # fmt: skip
    return {
        "delta_versions": len(vs),
        "delta_wire_ratio": sum(r["wire_bytes"] for r in src) / sum(r["dense_bytes"] for r in src),
        "delta_time_ratio": secs / dense if dense else None,
        "encode_s": encode,
        "apply_s": apply,
        "promote_s": slowest("promote_s", SRC),
        "encode_gbps": gbps["encode"],
        "apply_gbps": gbps["apply"],
        "link_gbps": gbps["link"],
        "codec_over_link": (min(gbps["encode"] or 0.0, gbps["apply"] or 0.0) / gbps["link"])
        if gbps["link"]
        else None,
    }


class _Printer:
    """A rank's results as JSON lines on stdout (a rank in a network namespace)."""

    def put(self, row: dict) -> None:
        print(json.dumps(row), flush=True)


def rank_main(config: str) -> None:
    """Entry of a rank started in a namespace: python -c '...rank_main(CONFIG_JSON)'."""
    c = json.loads(config)
    _rank(c["rank"], c["port"], argparse.Namespace(**c["args"]), _Printer(), c["store"],
          c["local"])  # fmt: skip


def _run_netns(args: argparse.Namespace) -> list[dict]:
    """The four ranks on four emulated hosts (network namespaces on a private bridge, every
    link shaped by tc tbf to --link-bit per direction); nothing leaves the machine."""
    from refitd.bench.cluster.netns import Network, unavailable

    why = unavailable()
    if why:
        raise RuntimeError(f"bench delta --link-bit: {why}")
    rows: list[dict] = []
    with Network([f"d{r}" for r in range(4)]) as net:
        net.shape(args.link_bit)
        store = net.hosts["d0"].address
        code = "import sys; from refitd.bench.delta import rank_main; rank_main(sys.argv[1])"
        procs = []
        for r in range(4):
            cfg = {"rank": r, "port": 29650, "args": vars(args) | {"host": store},
                   "store": store, "local": net.hosts[f"d{r}"].address}  # fmt: skip
            cfg["args"] = {k: v for k, v in cfg["args"].items() if not k.startswith("_")}
            argv = net.command(f"d{r}", [sys.executable, "-c", code, json.dumps(cfg)])
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        try:
            for p in procs:
                out, _ = p.communicate(timeout=args.timeout)
                if p.returncode:
                    raise RuntimeError(f"a bench rank failed (exit {p.returncode})")
                rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return rows


def run(args: argparse.Namespace) -> int:
    load = os.getloadavg()
    if args.link_bit:
        rows = _run_netns(args)
        print(json.dumps(_summary(rows, args, load)))
        return 0 if all(r["verified"] for r in rows) else 1
    store = dist.TCPStore(args.host, 0, 5, True, datetime.timedelta(seconds=args.timeout),
                          wait_for_workers=False)  # fmt: skip
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, args, out)) for r in range(4)]
    for p in procs:
        p.start()
    rows: list[dict] = []
    deadline = time.monotonic() + args.timeout
    want = 4 * args.versions
    try:
        while len(rows) < want:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a bench rank failed: exit codes {[p.exitcode for p in procs]}")
            try:
                rows.append(out.get(timeout=max(0.1, min(1.0, deadline - time.monotonic()))))
            except Exception:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bench delta: {len(rows)}/{want} results") from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    print(json.dumps(_summary(rows, args, load)))
    return 0 if all(r["verified"] for r in rows) else 1
