"""The README's example (examples/quickstart.py) runs as documented: two trainer ranks that
register independently (one may ask for a version before the other registered) refit an
inference engine three times, each version checked bit for bit on the inference side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


@pytest.mark.slow
def test_quickstart_example_refits_bit_for_bit() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [x for x in lines if x.startswith("version ")] == [
        f"version {v}: bit for bit" for v in (1, 2, 3)
    ]
    assert lines[-1] == "quickstart ok"
