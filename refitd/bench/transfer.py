"""`refitd bench transfer`: move a model through real transfer processes, executor and transport.

This process plays every worker: it holds the source shards (filled from a known pattern)
and the destination shards in shared memory, plans the refit with the real planner, and
drives one spawned transfer process per slot. The refit runs twice (the first maps memory
and warms buffers); the second is timed, then every destination shard is checked bit for
bit. The reference is measured in the same run between the same processes, on buffers in
shared memory pages like the workers' tensors: for gloo, each (source, destination) pair
sends its bytes as one large contiguous buffer (repeated when it exceeds --ref-chunk), all
pairs at once; for local, each slot memcpys its bytes. --repeat timed refits alternate with
reference runs and the medians are compared (the machine may be shared). With --verify, each
round also runs a verified refit (per-message checksums, compared as the controller does):
verify_ratio is the verified over the unverified throughput (medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import signal
import statistics
import sys
import time

import torch.distributed as dist

from refitd.bench.transfer_refs import (
    compare_reports,
    keep_memcpy_buffers,
    link_reference,
    links_summary,
    memcpy_reference,
    sent_memcpy_reference,
)
from refitd.bench.transfer_shards import mxfp8_context, place_shards, verify
from refitd.executor.chunks import WIRE_CHUNK
from refitd.memory.arena import SharedTensorArena
from refitd.node.process_handle import TransferProcessHandle
from refitd.plan.layout import TensorSpec
from refitd.plan.layouts import make_spec, megatron_layout
from refitd.plan.links import COLLECTIVE, MAPPED, RDMA, LinkPolicy, SlotSite
from refitd.plan.planner import Plan, PlanConfig, build_plan
from refitd.plan.program import encode_program
from refitd.plan.wire import MXFP8, PLAIN
from refitd.slot_protocol import DEFAULTS, Connect, Execute, Load, SnapshotInfo
from refitd.transport.mooncake_env import mooncake_unavailable_reason

UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "": 1}
COLS = 4096


def parse_bytes(text: str) -> int:
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in "kmg" else ""
    return int(float(t[: len(t) - len(unit)]) * UNITS[unit])


def parse_layout(text: str) -> int:
    key, _, value = text.partition("=")
    if key != "tp" or not value.isdigit():
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected tp=N")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--src-slots", type=int, default=2)
    parser.add_argument("--dst-slots", type=int, default=2)
    parser.add_argument("--transport", choices=("gloo", "local"), default="gloo")
    parser.add_argument(
        "--links",
        choices=("collective", "mapped", "rdma", "auto"),
        default="collective",
        help="path of the links between slots (all slots on one host; rdma: Mooncake over "
        "TCP on loopback); with mapped, rdma or auto the same model also runs collective in "
        "the same run, for comparison",
    )
    parser.add_argument("--wire", choices=("bf16", "mxfp8"), default="bf16")
    parser.add_argument("--src", type=parse_layout, default=None, help="tp=N (default: slots)")
    parser.add_argument("--dst", type=parse_layout, default=None, help="tp=N (default: slots)")
    parser.add_argument("--staging", type=parse_bytes, default=DEFAULTS.staging_bytes)
    parser.add_argument("--bucket", type=parse_bytes, default=parse_bytes("64MiB"))
    parser.add_argument(
        "--wire-chunk", type=parse_bytes, default=None, help="executor chunk (default: its own)"
    )
    parser.add_argument(
        "--staged-chunk",
        type=parse_bytes,
        default=None,
        help="chunk of staged segments (default: the executor's)",
    )
    parser.add_argument("--tensor-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    parser.add_argument("--ref-chunk", type=parse_bytes, default=parse_bytes("512MiB"))
    parser.add_argument(
        "--piece", type=parse_bytes, default=0,
        help="send chunks in pieces of this size, as on a link several models share",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed refits, each followed by a reference run"
    )
    parser.add_argument("--relay", action="store_true", help="plan with relays")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also time verified refits (checksums of sources and landed bytes)",
    )
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="snapshot release: source slots copy their sources, release, then send",
    )
    parser.add_argument(
        "--snapshot-bytes", type=parse_bytes, default=parse_bytes("4GiB"), help="cap per slot"
    )


def _specs(
    args: argparse.Namespace, n_tensors: int, rows: int, cols: int = COLS
) -> tuple[list, list, dict]:
    src_tp = args.src or args.src_slots
    dst_tp = args.dst or args.dst_slots
    for side, tp, slots in (("src", src_tp, args.src_slots), ("dst", dst_tp, args.dst_slots)):
        if slots % tp:
            raise SystemExit(f"--{side} tp={tp} does not divide --{side}-slots {slots}")
    local = args.transport == "local"
    if local and args.src_slots != args.dst_slots:
        raise SystemExit("--transport local needs --src-slots == --dst-slots (same slots)")
    dst_base = 0 if local else args.src_slots
    storage = MXFP8 if args.wire == "mxfp8" else PLAIN
    src: list[TensorSpec] = []
    dst: list[TensorSpec] = []
    shapes: dict[str, tuple[int, int]] = {}
    for k in range(n_tensors):
        name = f"layers.{k}.weight"
        shape = (rows, cols)
        shapes[name] = shape
        dim = k % 2  # column- then row-parallel
        for rank in range(args.src_slots):
            lay = megatron_layout(shape, tp_rank=rank % src_tp, tp_size=src_tp, partition_dim=dim)
            src.append(
                make_spec(
                    model="bench",
                    pool="trainer",
                    rank=rank,
                    slot=rank,
                    name=name,
                    global_shape=shape,
                    dtype="bfloat16",
                    layout=lay,
                )
            )
        for rank in range(args.dst_slots):
            lay = megatron_layout(shape, tp_rank=rank % dst_tp, tp_size=dst_tp, partition_dim=dim)
            dst.append(
                make_spec(
                    model="bench",
                    pool="infer",
                    rank=rank,
                    slot=dst_base + rank,
                    name=name,
                    global_shape=shape,
                    dtype="bfloat16",
                    layout=lay,
                    storage=storage,
                )
            )
    return src, dst, shapes


def run(args: argparse.Namespace) -> int:
    # a SIGTERM (e.g. from `timeout`) unwinds through `finally`, so shared memory is unlinked
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n_tensors = max(1, round(args.bytes / args.tensor_bytes))
    # tensors below 64 x COLS BF16 elements get fewer columns (64 rows, cols a multiple of 64)
    cols = min(COLS, max(64, args.tensor_bytes // (2 * 64) // 64 * 64))
    rows = max(64, args.bytes // n_tensors // (cols * 2) // 64 * 64)
    src, dst, shapes = _specs(args, n_tensors, rows, cols)
    model_bytes = sum(math.prod(s) * 2 for s in shapes.values())
    config = PlanConfig(
        bucket_bytes=args.bucket, sender_quantization=args.wire == "mxfp8", relay=args.relay
    )
    cplan = build_plan("bench", 1, src, dst, config)  # every message collective
    offers = (MAPPED,) if mooncake_unavailable_reason() else (MAPPED, RDMA)
    if args.links == RDMA and RDMA not in offers:
        raise SystemExit(f"--links rdma: {mooncake_unavailable_reason()}")
    sites = [SlotSite(s, "bench-host", "cpu", offers) for s in cplan.slots()]
    links = LinkPolicy.of(args.links, sites)
    plan = cplan
    if args.links != COLLECTIVE:
        plan = build_plan("bench", 1, src, dst, dataclasses.replace(config, links=links))
    slots = plan.slots()
    # one arena per slot, as one worker process per slot would have: a slot's tensors sit
    # side by side in shared memory, not interleaved with other ranks'
    arenas: dict[int, SharedTensorArena] = {}
    handles: list[TransferProcessHandle] = []
    try:
        shards = place_shards(src, dst, shapes, arenas)
        handles = [TransferProcessHandle(slot) for slot in slots]
        rank_of = {slot: r for r, slot in enumerate(slots)}
        if plan is not cplan:  # the one-sided writes' memcpy reference, as old as the shards
            keep_memcpy_buffers(args, handles, plan.send_bytes())
        store = _connect(args, handles, rank_of)  # noqa: F841 (the store serves while we run)
        snapshots = _load_programs(args, plan, handles, shards.mem, len(src))
        if plan is not cplan:
            _load_programs(args, cplan, handles, shards.mem, len(src))
        timed = _measure(args, plan, handles, src, rank_of, cplan)
        ok = verify(args, src, dst, shapes, shards.tensors, shards.scales)
        ok = ok and timed.mismatch is None
        out = _summary(args, plan, timed, model_bytes, len(slots), ok, snapshots)
        if plan is not cplan:
            out |= links_summary(plan, timed, out["bytes"])
        if args.wire == "mxfp8":
            seconds, ref_seconds = statistics.median(timed.runs), statistics.median(timed.refs)
            out |= mxfp8_context(
                shards.tensors[0], model_bytes, args.src_slots, ref_seconds, seconds
            )
        print(json.dumps(out))
        return 0 if out["verified"] else 1
    finally:
        for h in handles:
            h.close()
        for a in arenas.values():
            a.close()


def _connect(
    args: argparse.Namespace, handles: list[TransferProcessHandle], rank_of: dict[int, int]
) -> dist.TCPStore | None:
    """Form the transfer processes' communicator; returns the gloo rendezvous store (keep
    it alive while the processes run)."""
    if args.transport != "gloo":
        for h in handles:
            h.send(Connect(1, "", 0, 0, 1, "local", 10.0)).result()
        return None
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    pend = [
        h.send(
            Connect(
                1,
                "127.0.0.1",
                store.port,
                rank_of[h.slot],
                len(handles),
                "gloo",
                120.0,
                slot_ranks=rank_of,
            )
        )
        for h in handles
    ]
    for p in pend:
        p.result()
    return store


def _load_programs(
    args: argparse.Namespace,
    plan: Plan,
    handles: list[TransferProcessHandle],
    mem: dict,
    n_src: int,
) -> dict[int, dict]:
    """Load every slot's program with its tensors' handles; the snapshot replies by slot."""
    snapshots: dict[int, SnapshotInfo] = {}
    for h in handles:
        prog = plan.program(h.slot)
        if args.transport == "local" and (prog.sends or prog.recvs):
            raise SystemExit("--transport local: this layout needs copies between slots")
        load = Load(
            plan.digest,
            encode_program(prog),
            {i: mem[f"t{i}"].to_bytes() for i in prog.tensors},
            staging_bytes=args.staging,
            wire_chunk=args.wire_chunk,
            staged_chunk=args.staged_chunk,
            snapshot=tuple(range(n_src)) if args.snapshot else (),
            snapshot_bytes=args.snapshot_bytes,
        )
        reply = h.send(load).result()
        if reply.snapshot is not None:
            snapshots[h.slot] = reply.snapshot
    return snapshots


@dataclasses.dataclass
class _Timed:
    """The timed rounds: refit, reference and memcpy seconds (one per round), verified
    refit seconds (--verify), trainer-blocked seconds per unverified refit, the first
    checksum mismatch, and the reports of the last unverified and verified refits."""

    runs: list[float] = dataclasses.field(default_factory=list)
    refs: list[float] = dataclasses.field(default_factory=list)
    memcpys: list[float] = dataclasses.field(default_factory=list)
    verified: list[float] = dataclasses.field(default_factory=list)
    blocked: list[float] = dataclasses.field(default_factory=list)
    mismatch: str | None = None
    reports: list[dict] = dataclasses.field(default_factory=list)
    vreports: list[dict] = dataclasses.field(default_factory=list)
    # --links mapped or auto: a memcpy of each slot's sent bytes, the collective refit
    sent_memcpys: list[float] = dataclasses.field(default_factory=list)
    collective: list[float] = dataclasses.field(default_factory=list)


def _refit(
    args: argparse.Namespace,
    plan: Plan,
    handles: list[TransferProcessHandle],
    src_slots: set[int],
    refit_id: int,
    verify: bool = False,
) -> tuple[float, list[dict], float]:
    """One refit on every slot: its seconds, the slots' reports, and how long the trainer
    was held (until the last slot reading it released it: the event's wall time)."""
    t0, wall0 = time.monotonic(), time.time()
    released: dict[int, float] = {}
    pend = [
        h.send(Execute(plan.digest, refit_id, refit_id, args.timeout, verify, piece=args.piece))
        for h in handles
    ]
    reports = [
        p.result(lambda m, s=h.slot: released.setdefault(s, m.t)).report
        for h, p in zip(handles, pend, strict=True)
    ]
    seconds = time.monotonic() - t0
    blocked = max(released.get(s, wall0 + seconds) - wall0 for s in src_slots)
    return seconds, reports, blocked


def _measure(
    args: argparse.Namespace,
    plan: Plan,
    handles: list[TransferProcessHandle],
    src: list[TensorSpec],
    rank_of: dict[int, int],
    cplan: Plan,
) -> _Timed:
    """A warm-up refit, then --repeat rounds of refit, reference and memcpy (and a verified
    refit with --verify; with --links, a memcpy of the bytes each slot sent and a refit of
    the collective plan `cplan`): they alternate, and medians are compared, so load from
    other processes on the machine hits them alike."""
    src_slots = {s.slot for s in src}
    _refit(args, plan, handles, src_slots, 1)
    if plan is not cplan:
        _refit(args, cplan, handles, src_slots, 1 << 20)
    timed = _Timed()
    for k in range(max(1, args.repeat)):
        seconds, timed.reports, blocked = _refit(args, plan, handles, src_slots, 2 + 2 * k)
        timed.runs.append(seconds)
        timed.blocked.append(blocked)
        if plan is not cplan:
            piece = args.wire_chunk or WIRE_CHUNK
            timed.sent_memcpys.append(sent_memcpy_reference(args, handles, timed.reports, piece))
            cseconds, creports, _ = _refit(args, cplan, handles, src_slots, (1 << 20) + 1 + k)
            timed.collective.append(cseconds)
            timed.refs.append(link_reference(args, handles, cplan, rank_of, creports))
        else:
            timed.refs.append(link_reference(args, handles, plan, rank_of, timed.reports))
        timed.memcpys.append(memcpy_reference(args, handles, src))
        if args.verify:
            vseconds, timed.vreports, _ = _refit(
                args, plan, handles, src_slots, 3 + 2 * k, verify=True
            )
            timed.verified.append(vseconds)
            timed.mismatch = timed.mismatch or compare_reports(plan, handles, timed.vreports)
    return timed


def _summary(
    args: argparse.Namespace,
    plan: Plan,
    timed: _Timed,
    model_bytes: int,
    slots: int,
    ok: bool,
    snapshots: dict[int, SnapshotInfo],
) -> dict:
    """The bench's JSON document (the MXFP8 part is the caller's)."""
    runs, refs, reports = timed.runs, timed.refs, timed.reports
    seconds, ref_seconds = statistics.median(runs), statistics.median(refs)
    wire_bytes = sum(r.sent_bytes for r in reports)
    local_bytes = sum(r.local_bytes for r in reports)
    moved = wire_bytes if args.transport == "gloo" else local_bytes
    blocked, memcpy = statistics.median(timed.blocked), statistics.median(timed.memcpys)
    out = {
        "bench": "transfer",
        "transport": args.transport,
        "wire": args.wire,
        "model_bytes": model_bytes,
        "bytes": moved,
        "seconds": round(seconds, 4),
        "gbps": round(moved / seconds / 1e9, 3),
        "ref_gbps": round(moved / ref_seconds / 1e9, 3),
        # each refit against the reference run right after it (load drifts on a shared
        # machine), median over the pairs; and the ratio of the two medians
        "ratio": round(statistics.median(r / x for x, r in zip(runs, refs, strict=True)), 3),
        "ratio_of_medians": round(ref_seconds / seconds, 3),
        "seconds_all": [round(x, 4) for x in runs],
        "ref_seconds_all": [round(x, 4) for x in refs],
        "staging_peak_bytes": max(r.staging_peak_bytes for r in reports),
        "staging_cap_bytes": args.staging,
        "sources_released_s": round(max(r.sources_released_s for r in reports), 4),
        # trainer_blocked_s: refit start -> its last source slot released it (median);
        # over a memcpy of each source slot's bytes, all slots at once, same run
        "trainer_blocked_s": round(blocked, 4),
        "memcpy_s": round(memcpy, 4),
        "trainer_blocked_over_memcpy": round(blocked / max(memcpy, 1e-9), 3),
        "snapshot": _snapshot_summary(args, snapshots),
        "messages": sum(len(r.messages) for r in reports) // 2,
        "zero_copy_chunks": sum(m.zero_copy_chunks for r in reports for m in r.messages),
        "staged_chunks": sum(m.staged_chunks for r in reports for m in r.messages),
        "wire_over_bf16": round(plan.stats.remote_bytes / max(1, model_bytes), 4),
        "relay_bytes": plan.stats.relay_bytes,
        "phases_max": {
            k: round(max(r.phases.get(k, 0.0) for r in reports), 4) for k in reports[0].phases
        },
        "slots": slots,
        "piece": args.piece,
        "verified": ok,
    }
    if args.verify:
        vs = statistics.median(timed.verified)
        out |= {
            "verify_seconds_all": [round(x, 4) for x in timed.verified],
            "verify_gbps": round(moved / vs / 1e9, 3),
            "verify_ratio": round(seconds / vs, 3),
            "checksums_s_max": round(
                max(r.phases.get("checksums_s", 0.0) for r in timed.vreports), 4
            ),
            "checksum_mismatch": timed.mismatch,
        }
    return out


def _snapshot_summary(args, snapshots: dict[int, SnapshotInfo]) -> dict | None:
    if not args.snapshot:
        return None
    return {
        "bytes": sum(s.bytes for s in snapshots.values()),
        "fallback": sorted({s.fallback for s in snapshots.values() if s.fallback}),
    }
