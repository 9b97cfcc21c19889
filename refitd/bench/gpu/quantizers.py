"""GPU quantizer benchmark: Triton MXFP8 / block-FP8 / NVFP4 throughput vs a device copy.

Bandwidth counts bytes read + written (bf16 in; codes and scales out; a copy reads
and writes the bf16 tensor), measured in the same run, so `ratio` = quantizer GB/s / copy
GB/s is comparable across devices (target >= 0.7). It also checks the kernels bit for bit
against the CPU torch reference on every shape class, and the large outputs against the
reference run on the device.

    PYTHONPATH=. python3 -m refitd.bench.gpu.quantizers      # table + one JSON line
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from refitd.formats import fp8_block, mxfp8, nvfp4, triton_kernels
from refitd.formats.tuning import CANDIDATES, TileTuner, median_gpu_seconds
from refitd.plan.wire import (
    fp8_block_scale_shape,
    mxfp8_scale_shape,
    nvfp4_data_shape,
    nvfp4_scale_shape,
)

LARGE_SHAPE = (16384, 32768)  # 1 GiB of bf16
# every candidate the landing's tile tuner times (refitd.formats.tuning), each variant
MXFP8_CONFIGS = [c | {"fast": fast} for fast in (False, True) for c in CANDIDATES["mxfp8"]]
FP8_BLOCK_CONFIGS = [c | {"fast": fast} for fast in (False, True) for c in CANDIDATES["fp8_block"]]
NVFP4_CONFIGS = list(CANDIDATES["nvfp4"])
CHECK_SHAPES = {
    "mxfp8": [(1,), (7,), (33,), (31, 33), (3, 5, 100), (129, 257), (256, 4096)],
    "fp8_block": [(1,), (300,), (5, 7), (129, 257), (2, 300, 130), (512, 1024)],
}
NVFP4_CHECK_SHAPES = [(2,), (40,), (31, 34), (3, 5, 100), (129, 258), (256, 4096)]


def _median_seconds(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> float:
    return median_gpu_seconds(fn, iters, warmup)


def _hard_data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over a wide exponent range with zeros, subnormals, NaN and +-Inf."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-30, 30, (n,), generator=g).double())
    pick = torch.rand(n, generator=g)
    x[pick < 0.05] = 0.0
    tiny = torch.finfo(dtype).tiny
    x = torch.where((pick > 0.05) & (pick < 0.08), x.sign() * tiny * pick, x)
    if n > 300:
        x[100:164] = tiny * 0.3  # all-subnormal blocks
        x[200] = float("nan")
        x[250] = float("inf")
        x[-1] = float("-inf")
    return x.reshape(shape).to(dtype)


def _check_rows(device: str) -> list[dict]:
    rows = []
    for fmt, shapes in CHECK_SHAPES.items():
        for fast in (False, True):
            for dtype in (torch.bfloat16, torch.float32, torch.float16):
                for i, shape in enumerate(shapes):
                    x = _hard_data(shape, dtype, seed=i)
                    if fmt == "mxfp8":
                        want = mxfp8.mxfp8_quantize(x)
                        data = torch.empty(shape, dtype=torch.uint8, device=device)
                        scales = torch.empty(
                            mxfp8_scale_shape(shape), dtype=torch.uint8, device=device
                        )
                        triton_kernels.mxfp8_quantize_into(x.to(device), data, scales, fast=fast)
                        same_scales = torch.equal(scales.cpu(), want[1])
                    else:
                        want = fp8_block.fp8_block_quantize(x)
                        data = torch.empty(shape, dtype=torch.uint8, device=device)
                        scales = torch.empty(
                            fp8_block_scale_shape(shape), dtype=torch.float32, device=device
                        )
                        triton_kernels.fp8_block_quantize_into(
                            x.to(device), data, scales, fast=fast
                        )
                        same_scales = torch.equal(
                            scales.cpu().view(torch.int32), want[1].view(torch.int32)
                        )
                    rows.append(
                        {
                            "name": f"check {fmt} fast={fast} {str(dtype).removeprefix('torch.')}",
                            "shape": shape,
                            "gbps": None,
                            "copy_gbps": None,
                            "ratio": None,
                            "bit_identical": same_scales and torch.equal(data.cpu(), want[0]),
                        }
                    )
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for i, shape in enumerate(NVFP4_CHECK_SHAPES):
            x = _hard_data(shape, dtype, seed=i)
            want = nvfp4.nvfp4_quantize(x)
            got = [torch.empty_like(w, device=device) for w in want]
            triton_kernels.nvfp4_quantize_into(x.to(device), *got)
            same = all(
                torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))
                for g, w in zip(got, want, strict=True)
            )
            rows.append(
                {
                    "name": f"check nvfp4 fast=False {str(dtype).removeprefix('torch.')}",
                    "shape": shape,
                    "gbps": None,
                    "copy_gbps": None,
                    "ratio": None,
                    "bit_identical": same,
                }
            )
    return rows


def _nvfp4_rows(x: torch.Tensor, copy_gbps: float) -> list[dict]:
    """Timed NVFP4 configs on x (bytes: x read, packed data + scales + global scale
    written), each checked against the torch reference run on the device: the amax pass
    and the quantization, then ("one read") the quantization given x's amax."""
    want = nvfp4._reference(x)
    out = [torch.empty_like(w) for w in want]
    moved = x.nbytes + sum(w.nbytes for w in want)
    known = nvfp4.amax_bits(x)
    rows = []
    for config, amax in [(c, a) for a in (None, known) for c in NVFP4_CONFIGS]:
        seconds = _median_seconds(
            lambda c=config, a=amax: triton_kernels.nvfp4_quantize_into(x, *out, **c, amax=a)
        )
        gbps = moved / seconds / 1e9
        same = all(
            torch.equal(o.view(torch.uint8), w.view(torch.uint8))
            for o, w in zip(out, want, strict=True)
        )
        rows.append(
            {
                "name": f"nvfp4 {'one read ' if amax is not None else ''}{config}",
                "shape": tuple(x.shape),
                "gbps": gbps,
                "copy_gbps": copy_gbps,
                "ratio": gbps / copy_gbps,
                "bit_identical": same,
            }
        )
    return rows


def bench_nvfp4(device: str = "cuda") -> list[dict]:
    """The timed NVFP4 rows alone (and the copy they are compared with) on LARGE_SHAPE."""
    x = torch.randn(LARGE_SHAPE, dtype=torch.bfloat16, device=device)
    copy_dst = torch.empty_like(x)
    copy_gbps = 2 * x.nbytes / _median_seconds(lambda: copy_dst.copy_(x)) / 1e9
    return _nvfp4_rows(x, copy_gbps)


def tuner_picks(device: str = "cuda") -> dict:
    """What a landing's TileTuner picks on this device for a LARGE_SHAPE bf16 source of
    each quantizer, with every candidate's timing (as the transfer process times them)."""
    x = torch.randn(LARGE_SHAPE, dtype=torch.bfloat16, device=device)
    data = torch.empty(LARGE_SHAPE, dtype=torch.uint8, device=device)
    tuner = TileTuner()
    mx_s = torch.empty(mxfp8_scale_shape(LARGE_SHAPE), dtype=torch.uint8, device=device)
    tuner.choose("mxfp8", x, lambda c: triton_kernels.mxfp8_quantize_into(x, data, mx_s, **c))
    fb_s = torch.empty(fp8_block_scale_shape(LARGE_SHAPE), dtype=torch.float32, device=device)
    tuner.choose(
        "fp8_block", x, lambda c: triton_kernels.fp8_block_quantize_into(x, data, fb_s, **c)
    )
    out = [
        torch.empty(nvfp4_data_shape(LARGE_SHAPE), dtype=torch.uint8, device=device),
        torch.empty(nvfp4_scale_shape(LARGE_SHAPE), dtype=torch.uint8, device=device),
        torch.empty(1, dtype=torch.float32, device=device),
    ]
    tuner.choose("nvfp4", x, lambda c: triton_kernels.nvfp4_quantize_into(x, *out, **c))
    return {"picks": {k[0]: v for k, v in tuner.picks.items()}, "rows": tuner.report()}


def bench_quantizers(device: str = "cuda") -> list[dict]:
    """Rows of {name, shape, gbps, copy_gbps, ratio, bit_identical} (see the module doc)."""
    if not torch.cuda.is_available() or not triton_kernels.available():
        raise RuntimeError("bench_quantizers needs a CUDA device and triton")
    rows = _check_rows(device)
    x = torch.randn(LARGE_SHAPE, dtype=torch.bfloat16, device=device)
    copy_dst = torch.empty_like(x)
    copy_s = _median_seconds(lambda: copy_dst.copy_(x))
    copy_gbps = 2 * x.nbytes / copy_s / 1e9
    rows.append(
        {
            "name": "copy_ bf16 (reference)",
            "shape": LARGE_SHAPE,
            "gbps": copy_gbps,
            "copy_gbps": copy_gbps,
            "ratio": 1.0,
            "bit_identical": None,
        }
    )
    data = torch.empty(LARGE_SHAPE, dtype=torch.uint8, device=device)
    specs = [
        ("mxfp8", MXFP8_CONFIGS, triton_kernels.mxfp8_quantize_into, mxfp8._reference_codes,
         torch.empty(mxfp8_scale_shape(LARGE_SHAPE), dtype=torch.uint8, device=device)),
        ("fp8_block", FP8_BLOCK_CONFIGS, triton_kernels.fp8_block_quantize_into,
         fp8_block._reference_codes,
         torch.empty(fp8_block_scale_shape(LARGE_SHAPE), dtype=torch.float32, device=device)),
    ]  # fmt: skip
    for fmt, configs, kernel, reference, scales in specs:
        moved = x.nbytes + data.nbytes + scales.nbytes
        for config in configs:
            seconds = _median_seconds(lambda k=kernel, c=config, s=scales: k(x, data, s, **c))
            gbps = moved / seconds / 1e9
            want_data, want_scales = reference(x)
            same = torch.equal(data, want_data) and torch.equal(
                scales.view(torch.int32) if scales.dtype == torch.float32 else scales,
                want_scales.view(torch.int32) if scales.dtype == torch.float32 else want_scales,
            )
            del want_data, want_scales
            rows.append(
                {
                    "name": f"{fmt} {config}",
                    "shape": LARGE_SHAPE,
                    "gbps": gbps,
                    "copy_gbps": copy_gbps,
                    "ratio": gbps / copy_gbps,
                    "bit_identical": same,
                }
            )
    return rows + _nvfp4_rows(x, copy_gbps)


def summarize_checksum(rows: list[dict]) -> dict:
    """Checksum kernel GB/s and ratio to the copy, and whether every check held."""
    checks = [r for r in rows if r["name"].startswith("check checksum")]
    timed = {r["name"].split(" 1 GiB")[0]: r for r in rows if r["gbps"] is not None}
    kernel = timed.get("checksum kernel", {})
    return {
        "checksum_bit_identical": all(r["bit_identical"] for r in checks)
        and all(r["bit_identical"] for r in timed.values()),
        "checksum_checks": len(checks),
        "checksum_checks_on_kernel": sum(" kernel" in r["name"] for r in checks),
        "checksum_gbps_read": kernel.get("gbps"),
        "checksum_ratio_to_copy": kernel.get("ratio"),
        "checksum_torch_gbps_read": timed.get("checksum torch ops", {}).get("gbps"),
    }


def _format(v: object) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def summarize(rows: list[dict]) -> dict:
    """The best bit-identical config per format (its variant bit-identical on every shape
    class), its GB/s and ratio to the copy, and whether every check was bit-identical."""

    def variant_ok(fmt: str, fast: bool) -> bool:
        prefix = f"check {fmt} fast={fast} "
        return all(r["bit_identical"] for r in rows if r["name"].startswith(prefix))

    best = {}
    for fmt in ("mxfp8", "fp8_block", "nvfp4"):
        ok = [
            r
            for r in rows
            if r["name"].startswith(fmt + " ")
            and r["bit_identical"]
            and variant_ok(fmt, "'fast': True" in r["name"])
        ]
        if ok:
            best[fmt] = max(ok, key=lambda r: r["gbps"])
    checks = [r["bit_identical"] for r in rows if r["bit_identical"] is not None]
    return {
        "bench": "quantizers",
        "device": torch.cuda.get_device_name(),
        "copy_gbps": next(r["gbps"] for r in rows if r["name"].startswith("copy_")),
        **{f"{fmt}_gbps": r["gbps"] for fmt, r in best.items()},
        **{f"{fmt}_ratio": r["ratio"] for fmt, r in best.items()},
        **{f"{fmt}_config": r["name"].split(" ", 1)[1] for fmt, r in best.items()},
        "bit_identical": all(checks),
    }


def print_rows(rows: list[dict]) -> None:
    print(f"{'name':58} {'shape':16} {'GB/s':>8} {'copy':>8} {'ratio':>6} bit_identical")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(
            f"{r['name']:58} {r['shape']!s:16} {_format(r['gbps']) if r['gbps'] else '':>8} "
            f"{_format(r['copy_gbps']) if r['copy_gbps'] else '':>8} {ratio:>6} "
            f"{r['bit_identical']}"
        )


def main() -> int:
    rows = bench_quantizers()
    print(f"device: {torch.cuda.get_device_name()}")
    print_rows(rows)
    summary = summarize(rows)
    print(json.dumps(summary))
    return 0 if summary["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
