"""`refitd bench models`: two models refitting at once over one shaped link (tc tbf).

Three emulated hosts (refitd.bench.cluster.netns; needs root): the controller, a trainer
host holding one trainer rank of each model, an inference host holding one inference rank
of each. Every byte of both models crosses the one link between the trainer host and the
inference host, shaped to --rate-mbit. The controller's
model_weights gives the two models --weights. Each measured round, both trainers refit at
once (plans and communicator warm), and every version is checked bit for bit.

The second model is --ratio times the first's size and starts first, so it transfers during
the whole of the first's transfer. The first model's share is the part of the link's bytes
that are its own while both move: its bytes after its first chunk landed (the refit
record's first_landed_at and first_landed_bytes) over the bytes the trainer host sent on
its link from then to its last chunk landed (last_landed_at; sampled every 2 ms,
netns.LinkSampler; headers counted as in a round of the first model alone on the shaped
link). The second's share is the rest. Beside it, share_from_executes takes the interval from the first's executes
sent, which also holds the wait for its first bytes to get through the link's queues. The
target share is weight / sum of weights; the error is |share / target - 1|. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from refitd.bench.cluster import netns
from refitd.bench.cluster.host_workers import RankSpec
from refitd.bench.cluster.multihost import AgentSpec, ClusterError, MultiHostCluster
from refitd.demo.gpt import GptConfig

MODELS = ("policy", "critic")
SERVE_ARGS = ["--log-level", "warning", "--transfer-timeout-s", "120", "--pause-timeout-s", "30"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="tbf rate of the link")
    parser.add_argument(
        "--mb", type=float, default=32.0, help="the first model's size (MB of BF16)"
    )
    parser.add_argument(
        "--weights", default="1:1", help="the two models' weights (model_weights), as A:B"
    )
    parser.add_argument("--refits", type=int, default=3, help="measured rounds")
    parser.add_argument(
        "--ratio", type=float, default=8.0, help="the second model's size over the first's"
    )
    parser.add_argument(
        "--bucket-mb", type=float, default=4.0, help="largest message (bucket_bytes) in MiB"
    )


def run(args: argparse.Namespace) -> int:
    reason = netns.unavailable()
    if reason:
        print(f"refitd bench models: {reason}", file=sys.stderr)
        return 2
    weights = [float(w) for w in args.weights.split(":")]
    if len(weights) != 2 or min(weights) <= 0:
        print(f"refitd bench models: --weights {args.weights!r} is not A:B > 0", file=sys.stderr)
        return 2
    serve = [
        *SERVE_ARGS,
        "--links", "collective",
        "--bucket-bytes", str(int(args.bucket_mb * (1 << 20))),
        "--model-weights", ",".join(f"{m}={w:g}" for m, w in zip(MODELS, weights, strict=True)),
    ]  # fmt: skip
    nbytes = {
        m: GptConfig.for_megabytes(args.mb * f, layers=2).nbytes
        for m, f in zip(MODELS, (1.0, args.ratio), strict=True)
    }
    workers = {
        "trainer": [RankSpec("trainer", 0, 1, "cpu:0")],
        "infer": [RankSpec("infer", 0, 1, "cpu:0")],
    }
    agents = {h: AgentSpec("cpu:0") for h in workers}
    rounds = []
    with netns.Network(["ctl", "trainer", "infer"]) as net:
        cluster = MultiHostCluster(
            net, "ctl", agents, workers, args.mb, serve, model=MODELS[0],
            worker_args=["--no-pause-check"],
        )  # fmt: skip
        try:
            cluster.start(timeout_s=300)
            _second_model(cluster, workers, args.mb * args.ratio)
            for m in MODELS:  # plans, programs and the communicator in place
                _round(cluster, 1, [m])
            net.shape(int(args.rate_mbit * 1e6))
            with netns.LinkSampler(net, "trainer") as link:
                alone = _round(cluster, 2, [MODELS[0]])[MODELS[0]]
                link_rate = nbytes[MODELS[0]] / _seconds(alone)
                wire = _wire_bytes(link, alone) / nbytes[MODELS[0]]  # bytes on the link per byte
                for v in range(3, 3 + args.refits):
                    records = _round(cluster, v, [MODELS[1], MODELS[0]])  # the larger first
                    first_wire = nbytes[MODELS[0]] * wire
                    rounds.append(_shares(records, first_wire, link, weights))
        finally:
            cluster.close()
    worst = max(max(r["error"].values()) for r in rounds)
    worst_exec = max(max(r["error_from_executes"].values()) for r in rounds)
    doc = {
        "bench": "models",
        "rate_mbit": args.rate_mbit,
        "model_bytes": nbytes,
        "link_rate_mbit": link_rate * 8 / 1e6,
        "wire_over_payload": wire,
        "bucket_bytes": int(args.bucket_mb * (1 << 20)),
        "weights": dict(zip(MODELS, weights, strict=True)),
        "target_share": {m: w / sum(weights) for m, w in zip(MODELS, weights, strict=True)},
        "share_median": {m: statistics.median(r["share"][m] for r in rounds) for m in MODELS},
        "worst_error": worst,
        "within_10_percent": worst <= 0.10,
        "share_from_executes_median": {
            m: statistics.median(r["share_from_executes"][m] for r in rounds) for m in MODELS
        },
        "worst_error_from_executes": worst_exec,
        "within_10_percent_from_executes": worst_exec <= 0.10,
        "starved": any(min(r["share"].values()) <= 0.0 for r in rounds),
        "rounds": rounds,
        "bit_for_bit": True,
    }
    print(json.dumps(doc))
    return 0


def _child(model: str, host: str) -> str:
    return f"workers-{host}" if model == MODELS[0] else f"workers-{model}-{host}"


def _second_model(cluster: MultiHostCluster, workers: dict[str, list[RankSpec]], mb: float) -> None:
    """The second model's worker processes (`mb` each), beside the first's on the same hosts."""
    deadline = time.monotonic() + 120
    for host in workers:
        argv = cluster.worker_argv(host, MODELS[1])
        argv[argv.index("--mb") + 1] = str(mb)
        child = cluster.spawn(_child(MODELS[1], host), host, argv)
        if child.expect("ready", max(0.0, deadline - time.monotonic())) is None:
            raise ClusterError(f"{child.name}: not ready:\n{cluster.log_tail(child.name)}")

    def subscribed() -> bool:
        doc = cluster.status()
        m = next((m for m in doc.get("models", []) if m["name"] == MODELS[1]), None)
        ranks = [(p["role"], r) for p in (m or {}).get("pools", []) for r in p["ranks"]]
        return len(ranks) == 2 and all(
            r["live"] and (role == "source" or r["subscribed"]) for role, r in ranks
        )

    cluster.wait_for(f"{MODELS[1]} ranks live and subscribed", subscribed, deadline)


def _round(cluster: MultiHostCluster, version: int, models: list[str]) -> dict[str, dict]:
    """Every model in `models` refits `version`, the others once the first transfers;
    returns each one's refit record."""
    deadline = time.monotonic() + 320
    for i, m in enumerate(models):
        cluster.children[_child(m, "trainer")].send(f"step {version} 300")
        if i == 0 and len(models) > 1:
            cluster.wait_for(
                f"{m} v{version} transferring", lambda m=m: _transferring(cluster, m), deadline
            )
    for m in models:
        refit, commit = f"refit trainer 0 {version} ", f"commit infer 0 {version} "
        while True:
            got = [ln[len(refit) :].split()[0] for ln in cluster.lines_of(_child(m, "trainer"))
                   if ln.startswith(refit)]  # fmt: skip
            got += [ln[len(commit) :] for ln in cluster.lines_of(_child(m, "infer"))
                    if ln.startswith(commit)]  # fmt: skip
            if len(got) == 2 or (got and got[0] != "committed"):
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"{m} v{version}: no answer in time: {got}")
            time.sleep(0.05)
        if got != ["committed", "ok"]:
            raise ClusterError(f"{m} v{version}: {got}")
    records = {}
    for r in cluster.status().get("refits", []):
        if r["version"] == version and r["model"] in models:
            records[r["model"]] = r
    return records


def _transferring(cluster: MultiHostCluster, model: str) -> bool:
    doc = cluster.status()
    m = next((m for m in doc.get("models", []) if m["name"] == model), {})
    return (m.get("running") or {}).get("state") == "transferring"


def _seconds(record: dict) -> float:
    """A refit's transfer: from the executes sent to the last slot's DONE (the sender
    finishes while its last bytes still sit in socket buffers; the receiver's DONE comes
    once they landed)."""
    return float(record["transfer_done_at"]) - float(record["executes_sent_at"])


def _wire_bytes(link: netns.LinkSampler, record: dict) -> float:
    """Bytes the trainer host sent on its link during a refit's transfer (_seconds)."""
    return link.between(float(record["executes_sent_at"]), float(record["transfer_done_at"]))


def _shares(
    records: dict[str, dict], first_wire: float, link: netns.LinkSampler, weights: list[float]
) -> dict:
    """Each model's share of the link while both moved bytes (module docstring): the first
    model's bytes on the wire after its first chunk landed over all the link carried from
    then to its last chunk landed. Beside it, the share from its executes sent (that interval also
    holds the wait for its first bytes to get through)."""
    a, b = MODELS
    secs = {m: _seconds(records[m]) for m in MODELS}
    start = {m: float(records[m]["executes_sent_at"]) for m in MODELS}
    end = {m: float(records[m]["transfer_done_at"]) for m in MODELS}
    landed = float(records[a]["first_landed_at"])
    after_first = first_wire * (1.0 - records[a]["first_landed_bytes"] / records[a]["bytes"])
    share_a = after_first / link.between(landed, float(records[a]["last_landed_at"]))
    share = {a: share_a, b: 1.0 - share_a}
    link_bytes = _wire_bytes(link, records[a])
    from_exec = {a: first_wire / link_bytes, b: 1.0 - first_wire / link_bytes}
    target = {m: w / sum(weights) for m, w in zip(MODELS, weights, strict=True)}
    return {
        "share": share,
        "error": {m: abs(share[m] / target[m] - 1.0) for m in MODELS},
        "share_from_executes": from_exec,
        "error_from_executes": {m: abs(from_exec[m] / target[m] - 1.0) for m in MODELS},
        "first_landed_after_s": landed - start[a],
        "transfer_s": secs,
        "link_mbit_during_first": link_bytes * 8 / 1e6 / secs[a],
        "second_covers_first": start[b] <= start[a] and end[b] >= end[a],
    }
