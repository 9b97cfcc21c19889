"""`refitd bench load --faults`: a tenth of the metadata workers and one agent killed with
-9 in the middle of a refit; the refit fails naming one of them, the controller keeps its
other members' leases, and the refit after they come back commits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(200)
def test_bench_load_faults_tiny() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "refitd.cli.main", "bench", "load", "--faults",
            "--workers", "32", "--hold-s", "1", "--preset", "llama3-8b",
            "--trainer-layout", "tp=2,pp=2", "--inference-layout", "tp=2",
        ],
        capture_output=True, text=True, timeout=190,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["faults_killed_workers"] == 3 and doc["faults_killed_agent_slots"] == 4
    assert doc["faults_refit_before"] == "committed"
    assert doc["faults_refit_hit"] == "failed"
    # the reason names a departed member: an inference rank, trainer rank or agent killed
    assert any(w in doc["faults_refit_hit_reason"] for w in ("worker ", "agent ", "slots "))
    assert doc["faults_refit_after"] == "committed"
    assert (doc["faults_hangs"], doc["faults_torn"], doc["faults_untold"]) == (0, 0, 0)
    assert doc["faults_lost"] == 0 and doc["meta_workers_registered_at_end"] == 32
    assert doc["meta_heartbeats_refused"] == 0  # the survivors kept their leases
    assert 0 < doc["faults_recovery_s"] < 60
