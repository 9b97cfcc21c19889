"""`refitd demo`: the main job on one CPU machine.

Starts `refitd serve`, a trainer of 4 processes (tp=2, pp=2) holding a GPT-style model in
BF16, two inference pools of 2 processes each (tp=2; tp=1 x dp=2), then refits, each
checked bit for bit on every inference rank, printing seconds and GB/s per refit.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--refits", type=int, default=5, help="number of refits (default 5)")
    parser.add_argument(
        "--model-mb", type=float, default=384, help="model size in MB of BF16 weights (default 384)"
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the daemon and workers up after the refits (status page stays live)",
    )


def run(args: argparse.Namespace) -> int:
    from refitd.demo.run import DemoError, run_demo

    if args.refits < 1:
        raise SystemExit("--refits must be at least 1")
    try:
        run_demo(args.refits, args.model_mb, args.keep_running, say=lambda s: print(s, flush=True))
    except DemoError as err:
        print(f"demo FAILED: {err}", flush=True)
        return 1
    return 0
