"""Grouped landing on one GPU, timed in one process: the layouts of `refitd bench gpu`'s
receiver-side conversion and IPC refit parts, without processes or IPC, so the kernels'
own cost is visible next to the refit's.

Rows (CUDA events, median of 10): a copy_ of the same BF16 bytes (the reference); the
per-region calls (triton_kernels / copy_ per region); the grouped launch with several tile
configs; for plain copies also the fused copy + checksum of both sides and the checksum
alone. Bandwidth counts bytes read + written; ratio = GB/s over the copy's GB/s.

    PYTHONPATH=. python3 -m refitd.bench.gpu.grouped
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from refitd.bench.gpu.quantizers import _median_seconds
from refitd.formats import triton_kernels
from refitd.formats.grouped import GroupedLanding
from refitd.formats.region import dest_region
from refitd.plan.wire import fp8_block_scale_shape, mxfp8_scale_shape

ROWS, COLS, TENSORS = 16384, 8192, 4  # bench gpu's quant model: 4 x 256 MiB BF16, 2 shards
MX_TILES = [(8, 512, 4), (16, 512, 8), (32, 256, 8), (4, 1024, 4), (16, 256, 4)]
FB_TILES = [(32, 8), (16, 4), (64, 8)]
COPY_TILES = [(8, 512, 4), (16, 512, 8), (4, 1024, 4)]


def _row(name: str, seconds: float, moved: int, copy_gbps: float) -> dict:
    gbps = moved / seconds / 1e9
    return {"name": name, "ms": seconds * 1e3, "gbps": gbps, "ratio": gbps / copy_gbps}


def _copy_gbps(nbytes: int, device: str) -> float:
    a = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    return 2 * a.nbytes / _median_seconds(lambda: b.copy_(a)) / 1e9


def bench_quantize(fmt: str, device: str = "cuda") -> list[dict]:
    """Receiver-side conversion of row shards into persistent quantized buffers."""
    half = ROWS // 2
    srcs = [torch.randn((half, COLS), device=device).to(torch.bfloat16) for _ in range(2 * TENSORS)]
    datas = [torch.empty((ROWS, COLS), dtype=torch.uint8, device=device) for _ in range(TENSORS)]
    if fmt == "mxfp8":
        shape, dtype = mxfp8_scale_shape((ROWS, COLS)), torch.uint8
    else:
        shape, dtype = fp8_block_scale_shape((ROWS, COLS)), torch.float32
    scales = [torch.empty(shape, dtype=dtype, device=device) for _ in range(TENSORS)]
    regions = [
        dest_region(fmt, datas[k // 2], scales[k // 2], ((k % 2) * half, 0), (half, COLS))
        for k in range(2 * TENSORS)
    ]
    moved = sum(s.nbytes for s in srcs) + sum(d.nbytes for d in datas)
    moved += sum(s.nbytes for s in scales)
    copy_gbps = _copy_gbps(sum(s.nbytes for s in srcs), device)
    rows = [{"name": "copy_ (reference)", "ms": None, "gbps": copy_gbps, "ratio": 1.0}]
    kernel = getattr(triton_kernels, f"{fmt}_quantize_into")

    def per_region() -> None:
        for s, r in zip(srcs, regions, strict=True):
            kernel(s, r.values, r.scales)

    rows.append(_row(f"{fmt} per-region calls", _median_seconds(per_region), moved, copy_gbps))
    per_region()
    want = [(r.values.clone(), r.scales.clone()) for r in regions]
    for tile in MX_TILES if fmt == "mxfp8" else FB_TILES:
        g = GroupedLanding(torch.device(device), tiles={fmt: tile})
        assert all(g.add_quantize(s, r) for s, r in zip(srcs, regions, strict=True))
        g.build()
        row = _row(f"{fmt} grouped {tile}", _median_seconds(g.run), moved, copy_gbps)
        row["bit_identical"] = all(
            torch.equal(r.values, w[0]) and torch.equal(r.scales.view(w[1].dtype), w[1])
            for r, w in zip(regions, want, strict=True)
        )
        rows.append(row)
    return rows


def bench_copy(device: str = "cuda", tensors: int = 8, mib: int = 128) -> list[dict]:
    """Plain same-dtype copies: copy_ per region vs grouped, with and without checksums."""
    n = mib << 19  # bf16 elements
    srcs = [torch.randn(n, device=device).to(torch.bfloat16) for _ in range(tensors)]
    dsts = [torch.empty_like(s) for s in srcs]
    moved = 2 * sum(s.nbytes for s in srcs)
    copy_gbps = _copy_gbps(sum(s.nbytes for s in srcs), device)
    rows = [{"name": "copy_ one tensor (reference)", "ms": None, "gbps": copy_gbps, "ratio": 1.0}]

    def per_region() -> None:
        for s, d in zip(srcs, dsts, strict=True):
            d.copy_(s)

    rows.append(_row("copy_ per region", _median_seconds(per_region), moved, copy_gbps))
    for tile in COPY_TILES:
        g = GroupedLanding(torch.device(device), tiles={"copy": tile})
        assert all(g.add_copy(s, d) for s, d in zip(srcs, dsts, strict=True))
        g.build()
        runs: list[tuple[str, Callable[[], object], int]] = [
            ("copy", g.run, moved),
            ("copy + checksum both sides", lambda g=g: g.run(hash=True), moved),
            ("checksum only (bytes read)", g.hash_only, moved // 2),
        ]
        for what, fn, nbytes in runs:
            rows.append(
                _row(f"grouped {what} {tile}", _median_seconds(fn), nbytes, copy_gbps)  # type: ignore[arg-type]
            )
    return rows


def main() -> int:
    rows = bench_quantize("mxfp8") + bench_quantize("fp8_block") + bench_copy()
    print(f"device: {torch.cuda.get_device_name()}")
    for r in rows:
        ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
        print(
            f"{r['name']:52} {ms:>8} ms {r['gbps']:8.1f} GB/s {r['ratio']:.3f} {r.get('bit_identical', '')}"
        )
    print(json.dumps({"bench": "grouped", "device": torch.cuda.get_device_name(), "rows": rows}))
    return 0 if all(r.get("bit_identical", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
