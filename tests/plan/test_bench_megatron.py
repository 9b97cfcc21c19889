"""`refitd bench plan`'s Megatron-Core reference: absent, the line says so; present,
Megatron's plans over the metadata the bench fills move every destination element from the
right source element, and the line carries megatron_s and the ratio. Megatron-Core runs in
a child process (tests/plan/_megatron_child.py), never imported here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["bench", "plan", "--model", "llama3-8b", "--src", "tp=4,pp=2", "--src-world", "8"]
ARGV += ["--dst", "tp=2", "--dst-world", "2", "--repeat", "1"]


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core not installed (pip install 'refitd[bench-megatron]')",
)
def test_megatron_reference_plans_and_times():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_megatron_child.py")), *ARGV],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    checked = int(next(x for x in lines if x.startswith("checked ")).split()[1])
    assert checked > 200  # destination shards of both layouts, each equal to Megatron's split
    out = json.loads(lines[-1])
    assert out["megatron"][0].isdigit() and out["megatron_s"] > 0
    assert out["megatron_transfers"] > 0
    assert out["ratio_to_megatron"] == pytest.approx(out["plan_s"] / out["megatron_s"], rel=0.05)


def test_bench_plan_without_megatron_says_so(capsys, monkeypatch):
    from refitd.cli.main import main

    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # what an absent package looks like
    assert main(ARGV) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["megatron"] == "not installed"
    assert "megatron_s" not in out and "ratio_to_megatron" not in out
