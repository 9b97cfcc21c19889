"""`refitd` command line: each subcommand lives in its own module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from refitd.limits import raise_nofile_limit

# gRPC reads this when it is imported: with its fork handlers off, the controller may fork
# planning processes (refitd/server/plan_process.py); an explicit setting is kept.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("refitd.cli.serve", "run the controller and the local node agent"),
    "agent": ("refitd.cli.agent", "run a node agent that joins a controller"),
    "status": ("refitd.cli.status", "print the controller's status"),
    "explain": ("refitd.cli.explain", "which source ranks and boxes feed a destination tensor"),
    "demo": ("refitd.cli.demo", "trainer refitting two inference pools through the daemon (CPU)"),
    "version": ("refitd.cli.version", "print the refitd version"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "plan": ("refitd.bench.plan", "whole-cluster plan of a preset model"),
    "transfer": (
        "refitd.bench.transfer",
        "move a model through the real executor and transport",
    ),
    "control": ("refitd.bench.control", "control-plane overhead of cached-plan refits"),
    "fuzz": ("refitd.bench.fuzz", "bad-input fuzzing of a live controller (gRPC and HTTP)"),
    "gpu": ("refitd.bench.gpu.command", "GPU data plane: CUDA IPC, quantizers, NCCL"),
    "faults": ("refitd.bench.faults.command", "kill -9 each member at each refit phase (recovery)"),
    "load": (
        "refitd.bench.load.command",
        "1024 metadata workers of a large model, 1000 small refits",
    ),
    "staged": ("refitd.bench.staged", "pause window of a staged vs an in-place pool"),
    "lora": ("refitd.bench.lora", "LoRA adapter refits (no pause) beside a dense refit"),
    "cluster": (
        "refitd.bench.cluster.command",
        "refits across emulated hosts on shaped links (root)",
    ),
    "models": (
        "refitd.bench.cluster.models",
        "two models refitting at once over one shaped link: each one's share (root)",
    ),
    "simulate": (
        "refitd.bench.simulate.command",
        "replay a plan's messages on a link model (NICs, NVLink, fair sharing)",
    ),
    "delta": ("refitd.bench.delta", "delta refits vs dense refits of the same versions"),
    "backend": (
        "refitd.bench.backend",
        "vLLM backend start -> update -> finish vs a plain client refit of the same model",
    ),
    "rdma": ("refitd.bench.rdma", "one-sided Mooncake writes vs a raw Gloo pair (loopback)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Parser whose chosen subcommand (from argv) has its module's arguments loaded."""
    parser = argparse.ArgumentParser(prog="refitd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks (one JSON line each)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    table = [(sub, COMMANDS), (bench_sub, BENCHES)]
    for subparsers, commands in table:
        for name, (module, help_) in commands.items():
            p = subparsers.add_parser(name, help=help_)
            p.set_defaults(_module=module)
            if _chosen(argv, name, commands is BENCHES):
                importlib.import_module(module).add_arguments(p)
    return parser


def _chosen(argv: list[str], name: str, is_bench: bool) -> bool:
    words = [a for a in argv if not a.startswith("-")]
    if is_bench:
        return len(words) >= 2 and words[0] == "bench" and words[1] == name
    return bool(words) and words[0] == name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    raise_nofile_limit()
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
