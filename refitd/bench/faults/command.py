"""`refitd bench faults [--runs 20] [--cases trainer:transfer,...]`: the kill -9 suite.

For each case (role x phase) kill -9 the member at that phase of a refit, `--runs` times,
on one reused cluster (controller, node agent, 2 trainer and 2 inference rank processes):
hangs past the timeouts, torn versions served, paused ranks never told how the refit ended
(untold), refits failed only by the barrier timeout although a trainer rank was dead (late),
versions or registry entries lost after a controller restart, and the time from the restart
to the next committed refit. With --delta the refits are delta refits (the controller with
--delta-refits, sparse successive versions); the `delta` column counts the runs whose killed
refit had messages allowed as deltas. With --links the controller plans links that way
(default auto: the two slots of the suite's one host are linked by mapped memory). Prints a
table and one JSON line with the totals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

RECOVERY_TARGET_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=20, help="runs per case (default 20)")
    parser.add_argument(
        "--cases",
        default="all",
        help="comma-separated role:phase (roles trainer, inference, transfer, agent, "
        "controller; phases before, transfer, commit), or 'all'",
    )
    parser.add_argument("--mb", type=float, default=8.0, help="model size in MB (BF16)")
    parser.add_argument("--verbose", action="store_true", help="print every run")
    parser.add_argument(
        "--delta",
        action="store_true",
        help="delta refits (--delta-refits, sparse successive versions): kills mid-delta",
    )
    parser.add_argument(
        "--links",
        choices=("auto", "collective", "mapped", "rdma"),
        default="auto",
        help="the controller's links setting (default auto: mapped between the two slots; "
        "collective with --delta, whose deltas travel on the communicator)",
    )


def parse_cases(text: str) -> list[tuple[str, str]]:
    from refitd.bench.faults.suite import PHASES, ROLES

    if text == "all":
        return [(r, p) for r in ROLES for p in PHASES]
    cases = []
    for item in text.split(","):
        role, _, phase = item.strip().partition(":")
        if role not in ROLES or phase not in PHASES:
            raise SystemExit(
                f"--cases: {item!r} is not role:phase with role in {ROLES}, phase in {PHASES}"
            )
        cases.append((role, phase))
    return cases


def run(args: argparse.Namespace) -> int:
    from refitd.bench.faults.suite import FaultSuite, RunResult

    cases = parse_cases(args.cases)
    suite = FaultSuite(
        args.mb, say=lambda s: print(s, file=sys.stderr), delta=args.delta, links=args.links
    )
    rows: list[dict] = []
    t0 = time.monotonic()
    print(
        f"{'case':22} {'runs':>4} {'hit':>4} {'hangs':>5} {'torn':>4} {'untold':>6} {'late':>4} "
        f"{'lost':>4} "
        f"{'unrec':>5} {'back med s':>10} {'recov med s':>11} {'recov max s':>11} {'delta':>5}",
        flush=True,
    )
    try:
        for role, phase in cases:
            results: list[RunResult] = []
            for i in range(args.runs):
                r = suite.run(role, phase)
                results.append(r)
                bad_run = r.hangs or r.torn or r.untold or r.late or r.lost
                if args.verbose or bad_run or r.recovery_s is None:
                    print(
                        f"  {role}:{phase} run {i + 1}: hit={r.hit} hangs={r.hangs} "
                        f"torn={r.torn} untold={r.untold} late={r.late} lost={r.lost} back_s={r.back_s} recovery_s={r.recovery_s} delta={r.delta} "
                        f"{r.notes}",
                        file=sys.stderr,
                    )
            rec = [r.recovery_s for r in results if r.recovery_s is not None]
            back = [r.back_s for r in results if r.back_s is not None]
            rows.append(
                {
                    "case": f"{role}:{phase}",
                    "runs": len(results),
                    "hit": sum(r.hit for r in results),
                    "delta_hits": sum(r.delta is True for r in results),
                    "hangs": sum(r.hangs for r in results),
                    "torn": sum(r.torn for r in results),
                    "untold": sum(r.untold for r in results),
                    "late": sum(r.late for r in results),
                    "lost": sum(r.lost for r in results),
                    "back_median_s": statistics.median(back) if back else None,
                    "recovery_median_s": statistics.median(rec) if rec else None,
                    "recovery_max_s": max(rec) if rec else None,
                    "recovered": len(rec),
                }
            )
            _print_row(rows[-1])
    finally:
        suite.close()
    worst = max((r["recovery_max_s"] or 0.0 for r in rows), default=0.0)
    totals = {
        "bench": "faults",
        "runs_per_case": args.runs,
        "cases": len(rows),
        "runs": sum(r["runs"] for r in rows),
        "phase_hits": sum(r["hit"] for r in rows),
        "delta": args.delta,
        "links": suite.links,
        "paths": suite.paths,
        "delta_hits": sum(r["delta_hits"] for r in rows),
        "hangs": sum(r["hangs"] for r in rows),
        "torn": sum(r["torn"] for r in rows),
        "untold": sum(r["untold"] for r in rows),
        "late": sum(r["late"] for r in rows),
        "lost": sum(r["lost"] for r in rows),
        "unrecovered": sum(r["runs"] - r["recovered"] for r in rows),
        "recovery_max_s": worst,
        "recovery_target_s": RECOVERY_TARGET_S,
        "recovery_ratio_to_target": worst / RECOVERY_TARGET_S,
        "wall_s": round(time.monotonic() - t0, 1),
        "model_mb": args.mb,
    }
    print(json.dumps(totals))
    bad = ("hangs", "torn", "untold", "late", "lost", "unrecovered")
    ok = all(totals[k] == 0 for k in bad)
    return 0 if ok and worst < RECOVERY_TARGET_S else 1


def _print_row(row: dict) -> None:
    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    print(
        f"{row['case']:22} {row['runs']:>4} {row['hit']:>4} {row['hangs']:>5} {row['torn']:>4} "
        f"{row['untold']:>6} {row['late']:>4} {row['lost']:>4} {row['runs'] - row['recovered']:>5} {sec(row['back_median_s']):>10} {sec(row['recovery_median_s']):>11} "
        f"{sec(row['recovery_max_s']):>11} {row['delta_hits']:>5}",
        flush=True,
    )
