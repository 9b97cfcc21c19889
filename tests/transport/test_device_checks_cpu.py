"""The GPU bench's refit path (refitd.bench.gpu.checks.ipc_refit) run on the CPU: trainer and
inference processes with shared memory instead of CUDA IPC, a real transfer process, plain
and persistent quantized destinations (data + scales, and NVFP4's global scale, registered
together)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refitd.bench.gpu.checks import ipc_refit

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("storage", ["plain", "mxfp8", "fp8_block", "nvfp4"])
def test_ipc_refit_on_cpu_shared_memory(storage: str) -> None:
    out = ipc_refit(6 << 20, device="cpu", storage=storage, refits=2, timeout_s=60.0)
    assert out["verified"] is True, out
    assert out["data_ptrs_unchanged"] is True, out
    assert out["cpu_reference_spot_check"] is True, out
    assert out["bytes"] > 0 and out["seconds"] > 0 and out["snapshot_copy_s"] > 0


def test_staged_verified_and_many_small_refits_on_cpu_shared_memory() -> None:
    """The bench's staged pool with checksum verification, and its many-small-tensor model
    (here 40 tensors of 64 KiB-1 MiB), through the same path on the CPU."""
    out = ipc_refit(4 << 20, device="cpu", refits=2, timeout_s=60.0, staged=True, verify=True)
    assert out["verified"] and out["data_ptrs_unchanged"], out
    assert out["staged"] and out["apply_s"] > 0 and out["verify_cost"] > 0, out
    assert out["verified_refits"]["seconds"] > 0
    small = ipc_refit(0, device="cpu", refits=2, timeout_s=60.0, small=40)
    assert small["verified"] and small["data_ptrs_unchanged"], small
    assert small["tensors"] == 40 and small["source_shards"] == 40
    assert 40 * (64 << 10) <= small["bytes"] <= 40 * (1 << 20)


def test_bench_gpu_imports_without_grpc_pydantic_fastapi() -> None:
    blocked = "import sys\nfor m in ('grpc', 'pydantic', 'fastapi', 'pydantic_settings'):\n"
    blocked += "    sys.modules[m] = None\n"
    # everything `run` imports, then the CLI's parser
    code = blocked + "import refitd.bench.gpu.checks, refitd.bench.gpu.quantizers\n"
    code += "from refitd.cli.main import main\nraise SystemExit(main(['bench', 'gpu', '--help']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--gib" in r.stdout
