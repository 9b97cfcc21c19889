"""`refitd bench gpu`: the GPU data plane in one call, a table and one JSON line.

(a) ipc: trainer and inference processes on the device, a BF16 model registered through
    CUDA IPC handles, a real transfer process and executor; median of --refits refits,
    GB/s (bytes read + written), ratio to a device memcpy measured in the same run (target
    >= 0.6), trainer held time over a device-local snapshot copy (target <= 1.5);
(b) quant: receiver-side MXFP8 and block-FP8 refits into persistent destination buffers
    (data + scales through CUDA IPC): addresses unchanged across refits, bytes equal to
    refitd.formats' quantizer of the expected tensor (and to the CPU torch reference on a
    slice);
(b') nvfp4: the receiver-side NVFP4 refit of (b) (the trainer holds whole tensors: NVFP4
    is landed whole; each tensor's amax pass and quantization run back to back, so a
    tensor that fits in L2, --quant-tensor-mib 32 as an MoE expert, is read from memory
    about once), the same with snapshot release (the capture folds each source's
    amax as it copies it, so the quantization reads the snapshot once), and the Triton
    NVFP4 quantizer alone vs the copy bandwidth;
(c) staged: the refit of (a) into a staged pool (staging buffers in the transfer process,
    then applied in place), each refit timed with and without --verify-checksums style
    verification (verify_cost = verified / unverified, target <= 1.3); (a) reports its
    verify_cost too;
(d) small: --small-count tensors of 64 KiB-1 MiB per rank through CUDA IPC (target >= 0.6);
(d') snapshot: the refit of (a) with snapshot release (the transfer process copies the
    trainer's shard into device memory, releases it, then lands from the copy): trainer
    held over a device-local copy of its shard (target <= 1.2);
(e) nccl: the NCCL transport through the executor, one rank sending to itself;
(f) kernels: Triton quantizers vs the torch reference and the copy bandwidth, and the
    checksum kernel vs the CPU checksum (bit for bit) and the copy bandwidth.
Local copies and conversions run as grouped Triton launches (refitd.formats.grouped).

Imports torch, numpy, msgpack (and triton for (d)) only: no grpc, pydantic or fastapi.
`--device cpu` runs (a)-(d) on CPU shared memory (a dry run of the same code path).

    refitd bench gpu [--gib 8] [--quant-gib 1] [--quant-tensor-mib 256] [--refits 5]
                     [--small-count 10000]
                     [--only ipc,quant,nvfp4,staged,small,snapshot,nccl,kernels]
    PYTHONPATH=. python3 -m refitd.bench.gpu.command
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable

import torch

PARTS = ("ipc", "quant", "nvfp4", "staged", "small", "snapshot", "nccl", "kernels")
CPU_PARTS = ("ipc", "quant", "nvfp4", "staged", "small", "snapshot")
HELD_TARGET = 1.5
SNAPSHOT_HELD_TARGET = 1.2  # trainer held over a device-local copy, snapshots on
IPC_RATIO_TARGET = 0.6
QUANT_RATIO_TARGET = 0.7
VERIFY_COST_TARGET = 1.3
SMALL_RATIO_TARGET = 0.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=8.0, help="BF16 model of the IPC refit")
    parser.add_argument(
        "--quant-gib", type=float, default=1.0, help="BF16 model of the MXFP8/FP8/NVFP4 refits"
    )
    parser.add_argument(
        "--quant-tensor-mib",
        type=float,
        default=256.0,
        help="size of each tensor of the MXFP8/FP8/NVFP4 refits (an MoE expert's: 28-32)",
    )
    parser.add_argument("--nccl-gib", type=float, default=2.0, help="bytes of the NCCL check")
    parser.add_argument("--refits", type=int, default=5, help="timed refits (median)")
    parser.add_argument(
        "--small-count", type=int, default=10000, help="tensors per rank of the small part"
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run")
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument("--timeout", type=float, default=300.0)


def _gib(x: float) -> int:
    return int(x * (1 << 30))


def _mib(x: float) -> int:
    return int(x * (1 << 20))


def _attempt(fn: Callable[[], dict]) -> dict:
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as e:  # report every part even if one fails
        out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
    out["wall_s"] = round(time.monotonic() - t0, 2)
    return out


def run(args: argparse.Namespace) -> int:
    from refitd.bench.gpu import checks as gpu_checks

    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"--only: unknown parts {unknown}; known: {PARTS}")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu", "error": "no CUDA device (use --device cpu)"}))
        return 2
    if not cuda:
        parts = [p for p in parts if p in CPU_PARTS]
    out: dict = {
        "bench": "gpu",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
    }
    if "ipc" in parts:
        out["ipc"] = _attempt(
            lambda: gpu_checks.ipc_refit(
                _gib(args.gib), args.device, "plain", args.refits, args.timeout, verify=True
            )
        )

    def quantized(storage: str, snapshot: bool = False) -> dict:
        return gpu_checks.ipc_refit(
            _gib(args.quant_gib), args.device, storage, max(2, args.refits), args.timeout,
            snapshot=snapshot, tensor_bytes=_mib(args.quant_tensor_mib),
        )  # fmt: skip

    if "quant" in parts:
        for storage in ("mxfp8", "fp8_block"):
            out[f"ipc_{storage}"] = _attempt(lambda s=storage: quantized(s))
    if "nvfp4" in parts:
        out["ipc_nvfp4"] = _attempt(lambda: quantized("nvfp4"))
        out["ipc_nvfp4_snapshot"] = _attempt(lambda: quantized("nvfp4", snapshot=True))
        if cuda:
            out["nvfp4_kernel"] = _attempt(_nvfp4_kernel)
    if "staged" in parts:
        out["staged"] = _attempt(
            lambda: gpu_checks.ipc_refit(
                _gib(args.gib), args.device, "plain", args.refits, args.timeout,
                staged=True, verify=True,
            )
        )  # fmt: skip
    if "small" in parts:
        out["small"] = _attempt(
            lambda: gpu_checks.ipc_refit(
                0, args.device, "plain", args.refits, args.timeout, small=args.small_count
            )
        )
    if "snapshot" in parts:
        out["snapshot"] = _attempt(
            lambda: gpu_checks.ipc_refit(
                _gib(args.gib), args.device, "plain", args.refits, args.timeout, snapshot=True
            )
        )
    if "nccl" in parts:
        out["nccl"] = _attempt(lambda: gpu_checks.nccl_self_transfer(_gib(args.nccl_gib)))
    if "kernels" in parts:
        out["kernels"] = _attempt(lambda: _kernels())
    ok = _print_table(out)
    out["ok"] = ok
    print(json.dumps(out, default=str))
    return 0 if ok else 1


def _kernels() -> dict:
    from refitd.bench.gpu import checksum as checksum_bench
    from refitd.bench.gpu import quantizers

    rows = quantizers.bench_quantizers()
    summary = quantizers.summarize(rows)
    hash_rows = checksum_bench.bench_checksum()
    summary.update(quantizers.summarize_checksum(hash_rows))
    return {"summary": summary, "rows": rows + hash_rows}


def _nvfp4_kernel() -> dict:
    from refitd.bench.gpu import quantizers

    rows = quantizers.bench_nvfp4()
    picks = {}
    for one_read in (False, True):  # the amax pass and the quantization; given the amax
        ok = [r for r in rows if r["bit_identical"] and ("one read" in r["name"]) == one_read]
        best = max(ok, key=lambda r: r["gbps"], default=None)
        picks[one_read] = best and {k: best[k] for k in ("name", "gbps", "ratio")}
    best = picks[False]
    return {
        "tuner": quantizers.tuner_picks(),
        "copy_gbps": round(rows[0]["copy_gbps"], 1),
        "bit_identical": all(r["bit_identical"] for r in rows),
        "best": best,
        "best_one_read": picks[True],
        "target_met": best is not None and best["ratio"] >= QUANT_RATIO_TARGET,
        "rows": [{k: r[k] for k in ("name", "gbps", "ratio", "bit_identical")} for r in rows],
    }


def _print_table(out: dict) -> bool:
    """Human table of every part; True when every part ran and every check held."""
    ok = True
    print(f"refitd bench gpu on {out['device']} (torch {out['torch']})")
    print(f"{'part':22} {'GB':>7} {'ms':>9} {'GB/s':>8} {'ref':>8} {'ratio':>6}  checks")
    for key in (
        "ipc", "ipc_mxfp8", "ipc_fp8_block", "ipc_nvfp4", "ipc_nvfp4_snapshot", "staged",
        "small", "snapshot", "nccl",
    ):  # fmt: skip
        r = out.get(key)
        if r is None:
            continue
        if "error" in r:
            ok = False
            print(f"{key:22} ERROR {r['error']}")
            continue
        checks = {
            k: r[k]
            for k in ("verified", "data_ptrs_unchanged", "cpu_reference_spot_check")
            if k in r
        }
        ok = ok and all(checks.values())
        gbps = r.get("gbps_rw", r.get("gbps"))
        ref = r.get("ref_memcpy_gbps_rw", r.get("ref_d2d_gbps"))
        print(
            f"{key:22} {r['bytes'] / 1e9:7.2f} {r['seconds'] * 1e3:9.3f} {gbps:8.1f} "
            f"{ref:8.1f} {r['ratio']:6.3f}  {checks}"
        )
        _targets(key, r)
        extra = {k: r[k] for k in ("execute_s", "apply_s", "verify_cost", "tensors") if k in r}
        if extra:
            print(f"{'':22} {extra}")
        if "host_us" in r:
            print(f"{'':22} fixed host time per refit (us): {r['host_us']}")
        if "trainer_held_s" in r:
            print(
                f"{'':22} trainer held {r['trainer_held_s'] * 1e3:.3f} ms, snapshot copy "
                f"{r['snapshot_copy_s'] * 1e3:.3f} ms: {r['held_over_snapshot']}x "
                f"(target <= {SNAPSHOT_HELD_TARGET if key == 'snapshot' else HELD_TARGET}); "
                f"phases {r['phases']}"
            )
    if "ipc" in out and "ratio" in out["ipc"]:
        r = out["ipc"]
        out["ipc"]["targets_met"] = (
            r["ratio"] >= IPC_RATIO_TARGET and r["held_over_snapshot"] <= HELD_TARGET
        )
    nk = out.get("nvfp4_kernel")
    if nk is not None:
        ok = ok and nk.get("bit_identical", False)
        print(f"{'nvfp4 kernel':22} {nk}")
    k = out.get("kernels")
    if k is not None and "summary" in k:
        ok = ok and k["summary"].get("checksum_bit_identical", True)
    if k is not None:
        if "error" in k:
            ok = False
            print(f"{'kernels':22} ERROR {k['error']}")
        else:
            from refitd.bench.gpu import quantizers

            quantizers.print_rows(k["rows"])
            s = k["summary"]
            ok = ok and s["bit_identical"]
            for fmt in ("mxfp8", "fp8_block", "nvfp4"):
                if f"{fmt}_ratio" in s:
                    s[f"{fmt}_target_met"] = s[f"{fmt}_ratio"] >= QUANT_RATIO_TARGET
            rows = k.pop("rows")  # the JSON line keeps the timed rows and failed checks
            k["timed"] = [
                {
                    "name": r["name"],
                    "gbps": r["gbps"],
                    "ratio": r["ratio"],
                    "bit": r["bit_identical"],
                }
                for r in rows
                if r["gbps"] is not None
            ]
            k["failed_checks"] = [
                f"{r['name']} {r['shape']}" for r in rows if r["bit_identical"] is False
            ]
    return ok


def _targets(key: str, r: dict) -> None:
    """targets_met of the parts that have one (ipc's is set with its held time)."""
    met = []
    if key in ("ipc_mxfp8", "ipc_fp8_block", "ipc_nvfp4"):
        met.append(r["ratio"] >= QUANT_RATIO_TARGET)
    if key == "small":
        met.append(r["ratio"] >= SMALL_RATIO_TARGET)
    if key == "snapshot":
        met.append(r["held_over_snapshot"] <= SNAPSHOT_HELD_TARGET)
    if "verify_cost" in r:
        r["verify_cost_target_met"] = r["verify_cost"] <= VERIFY_COST_TARGET
    if met:
        r["targets_met"] = all(met)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m refitd.bench.gpu.command", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
