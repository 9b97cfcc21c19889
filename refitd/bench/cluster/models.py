"""`refitd bench models`: two models refitting at once over one shaped link (tc tbf).

Three emulated hosts (refitd.bench.cluster.netns; needs root): the controller, a trainer
host holding one trainer rank of each model, an inference host holding one inference rank
of each. Both models have the same size; every byte of both crosses the one link between
the trainer host and the inference host, shaped to --rate-mbit. The controller's
model_weights gives the two models --weights. Each measured round, both trainers refit at
once (plans and communicator warm), and every version is checked bit for bit.

The share is read off the two transfers' starts and ends: the link is busy from the first
start to the last end, so its rate is both models' bytes over that time; the model that
ends first sent its bytes (less those it sent alone before the other started) while both
ran, so its share is those bytes over the link's bytes from the later start to its end,
and the other's share is the rest. The target share is weight / sum of weights; the
error is |share / target - 1|. One JSON line.
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
    parser.add_argument("--mb", type=float, default=64.0, help="each model's size (MB of BF16)")
    parser.add_argument(
        "--weights", default="1:1", help="the two models' weights (model_weights), as A:B"
    )
    parser.add_argument("--refits", type=int, default=3, help="measured rounds")
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
    model_bytes = GptConfig.for_megabytes(args.mb, layers=2).nbytes
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
            _second_model(cluster, workers)
            for m in MODELS:  # plans, programs and the communicator in place
                _round(cluster, 1, [m])
            net.shape(int(args.rate_mbit * 1e6))
            for v in range(2, 2 + args.refits):
                rounds.append(_shares(_round(cluster, v, list(MODELS)), model_bytes, weights))
        finally:
            cluster.close()
    worst = max(max(r["error"].values()) for r in rounds)
    doc = {
        "bench": "models",
        "rate_mbit": args.rate_mbit,
        "model_bytes": model_bytes,
        "bucket_bytes": int(args.bucket_mb * (1 << 20)),
        "weights": dict(zip(MODELS, weights, strict=True)),
        "target_share": {m: w / sum(weights) for m, w in zip(MODELS, weights, strict=True)},
        "share_median": {m: statistics.median(r["share"][m] for r in rounds) for m in MODELS},
        "worst_error": worst,
        "within_10_percent": worst <= 0.10,
        "starved": any(min(r["share"].values()) <= 0.0 for r in rounds),
        "rounds": rounds,
        "bit_for_bit": True,
    }
    print(json.dumps(doc))
    return 0


def _child(model: str, host: str) -> str:
    return f"workers-{host}" if model == MODELS[0] else f"workers-{model}-{host}"


def _second_model(cluster: MultiHostCluster, workers: dict[str, list[RankSpec]]) -> None:
    """The second model's worker processes, beside the first's on the same hosts."""
    deadline = time.monotonic() + 120
    for host in workers:
        argv = cluster.worker_argv(host, MODELS[1])
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
    """Every model in `models` refits `version` at once; returns each one's refit record."""
    for m in models:
        cluster.children[_child(m, "trainer")].send(f"step {version} 300")
    deadline = time.monotonic() + 320
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


def _shares(records: dict[str, dict], nbytes: int, weights: list[float]) -> dict:
    """Each model's share of the link while both transferred (module docstring)."""
    start = {m: float(records[m]["executes_sent_at"]) for m in MODELS}
    end = {m: float(records[m]["transfer_done_at"]) for m in MODELS}
    t0, t1 = min(start.values()), max(start.values())  # both run from t1
    early = min(MODELS, key=lambda m: start[m])
    first, last = sorted(MODELS, key=lambda m: end[m])
    rate = 2 * nbytes / (end[last] - t0)  # the link busy from the first start to the last end
    alone = rate * (t1 - t0) if first == early else 0.0  # sent before the other started
    share_first = (nbytes - alone) / (rate * (end[first] - t1))
    share = {first: share_first, last: 1.0 - share_first}
    target = {m: w / sum(weights) for m, w in zip(MODELS, weights, strict=True)}
    return {
        "share": share,
        "error": {m: abs(share[m] / target[m] - 1.0) for m in MODELS},
        "transfer_s": {m: end[m] - start[m] for m in MODELS},
        "start_skew_s": abs(start[MODELS[0]] - start[MODELS[1]]),
        "both_s": end[last] - t0,
    }
