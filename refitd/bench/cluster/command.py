"""`refitd bench cluster`: refits across emulated hosts whose every link is shaped (tc tbf).

Hosts are network namespaces on a private bridge (refitd.bench.cluster.netns; needs root): the
controller on its own host, the trainer (tp=2, two ranks) on a second, and one inference
pool of one rank per further host (3 hosts: one pool; 4 hosts: two pools, fed by relay).
Every host's link is shaped to --rate-mbit in each direction on both ends.

The link bound is the time the busiest host needs at the link rate for the bytes it must
send or receive: the trainer host must send every byte of the model once, and each
inference host must receive its replica, so bound = model bytes / rate. The achieved ratio
is bound / refit time (the controller's refit seconds, median over --refits; 1.0 would be
the raw link, TCP/IP framing alone costs ~4 %). The same number of refits is first run on
unshaped links as a reference: what the machine's CPUs allow (on a busy machine the
CPU-bound time can approach the link bound, and the two do not overlap perfectly). Also reported: the bytes each host really
sent and received per refit (switch counters), and the trainer's Refit call time. Every
version is checked bit for bit on every inference rank. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from refitd.bench.cluster import netns
from refitd.bench.cluster.host_workers import RankSpec
from refitd.bench.cluster.multihost import AgentSpec, MultiHostCluster
from refitd.demo.gpt import GptConfig

SERVE_ARGS = ["--log-level", "warning", "--transfer-timeout-s", "120", "--pause-timeout-s", "30"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=3, choices=(3, 4), help="emulated hosts")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="tbf rate per link")
    parser.add_argument("--mb", type=float, default=128.0, help="model size (MB of BF16)")
    parser.add_argument("--refits", type=int, default=3, help="measured refits")
    parser.add_argument("--warmup", type=int, default=1, help="refits before measuring")
    parser.add_argument(
        "--bucket-mb", type=float, default=8.0, help="largest message (bucket_bytes) in MiB"
    )
    parser.add_argument(
        "--plan-schedule",
        choices=("auto", "lanes", "serial"),
        default="auto",
        help="the controller's plan_schedule (auto: lanes under gloo)",
    )
    parser.add_argument(
        "--relay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the controller's relay setting",
    )
    parser.add_argument(
        "--links",
        choices=("collective", "rdma", "auto"),
        default="collective",
        help="the controller's links setting: collective (Gloo between hosts), rdma "
        "(Mooncake writes over TCP, where it imports) or auto",
    )
    parser.add_argument(
        "--relay-chain",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the controller's relay_chain setting (4 hosts: the first pool forwards all)",
    )


def topology(hosts: int) -> tuple[list[str], dict[str, list[RankSpec]]]:
    names = ["ctl", "trainer", *[f"infer{i}" for i in range(hosts - 2)]]
    workers = {"trainer": [RankSpec("trainer", r, 2, f"cpu:{r}") for r in range(2)]}
    for i in range(hosts - 2):
        workers[f"infer{i}"] = [RankSpec(f"pool{i}", 0, 1, "cpu:0")]
    return names, workers


def run(args: argparse.Namespace) -> int:
    reason = netns.unavailable()
    if reason:
        print(f"refitd bench cluster: {reason}", file=sys.stderr)
        return 2
    names, workers = topology(args.hosts)
    agents = {h: AgentSpec(",".join(r.device for r in rs)) for h, rs in workers.items()}
    serve = [
        *SERVE_ARGS,
        "--bucket-bytes",
        str(int(args.bucket_mb * (1 << 20))),
        "--plan-schedule",
        args.plan_schedule,
        "--relay" if args.relay else "--no-relay",
        "--relay-chain" if args.relay_chain else "--no-relay-chain",
        "--links",
        args.links,
    ]
    model_bytes = GptConfig.for_megabytes(args.mb, layers=2).nbytes
    rate_bps = args.rate_mbit * 1e6 / 8
    with netns.Network(names) as net:
        cluster = MultiHostCluster(
            net, "ctl", agents, workers, args.mb, serve, worker_args=["--no-pause-check"]
        )
        try:
            cluster.start(timeout_s=300)
            for v in range(1, args.warmup + 1):
                _measure(cluster, v)
            v0 = args.warmup + 1
            # The same refits on unshaped links: what this machine's CPUs allow (reference).
            unshaped = [_measure(cluster, v)[0] for v in range(v0, v0 + args.refits)]
            net.shape(int(args.rate_mbit * 1e6))
            runs = [_measure(cluster, v) for v in range(v0 + args.refits, v0 + 2 * args.refits)]
        finally:
            cluster.close()
    refit_s = [r[0] for r in runs]
    call_s = [r[1] for r in runs]
    moved = [r[2] for r in runs]
    parts = [r[3] for r in runs]
    busiest = max(max(m[h]) for m in moved for h in m)
    bound_s = model_bytes / rate_bps
    refit = statistics.median(refit_s)
    doc = {
        "bench": "cluster",
        "hosts": args.hosts,
        "inference_pools": args.hosts - 2,
        "rate_mbit": args.rate_mbit,
        "model_bytes": model_bytes,
        "bucket_bytes": int(args.bucket_mb * (1 << 20)),
        "plan_schedule": args.plan_schedule,
        "relay": args.relay,
        "relay_chain": args.relay_chain,
        "links": args.links,
        "refits": len(refit_s),
        "link_bound_s": bound_s,
        "refit_s_median": refit,
        "refit_s": refit_s,
        "call_s_median": statistics.median(call_s),
        "ratio_to_link_bound": bound_s / refit,
        "unshaped_refit_s_median": statistics.median(unshaped),
        "unshaped_refit_s": unshaped,
        "busiest_host_link_bytes": busiest,
        "busiest_over_model_bytes": busiest / model_bytes,
        "link_bytes_sent_received_per_host": moved[-1],
        "phases_s_last": parts[-1],
        "bit_for_bit": True,
    }
    print(json.dumps(doc))
    return 0


def _measure(cluster: MultiHostCluster, v: int) -> tuple[float, float, dict, dict]:
    """One verified refit: controller seconds, call seconds, link bytes per host, phases."""
    before = cluster.net.link_bytes()
    out = cluster.refit(v, timeout_s=600)
    if out.state != "committed" or set(out.commits.values()) != {"ok"}:
        raise RuntimeError(f"version {v}: {out.states} {out.messages} {out.commits}")
    after = cluster.net.link_bytes()
    moved = {h: [after[h][i] - before[h][i] for i in (0, 1)] for h in after}
    record = _record(cluster, v)
    return float(record["seconds"]), out.seconds, moved, _parts(record)


def _record(cluster: MultiHostCluster, version: int) -> dict:
    doc = cluster.status()
    for r in doc.get("refits", []):
        if r["model"] == cluster.model and r["version"] == version:
            return r
    raise RuntimeError(f"version {version} is not in the controller's refit history")


def _parts(record: dict) -> dict[str, float]:
    """Where a refit's time went: pause handshake, control before the executes, the
    slowest slot's data-plane time, control after the last DONE."""
    slots = record.get("slots", {})
    return {
        "pause_s": float(record.get("pause_s", 0.0)),
        "control_start_s": float(record.get("control_start_s", 0.0)),
        "slowest_slot_s": max((float(s["seconds"]) for s in slots.values()), default=0.0),
        "control_end_s": float(record.get("control_end_s", 0.0)),
    }
