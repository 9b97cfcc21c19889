"""GPU timing of the positional checksum (refitd.executor.checksums): the Triton kernel of
refitd.formats.grouped against the CPU checksum bit for bit, then its bandwidth against a
device copy, for `refitd bench gpu`."""

from __future__ import annotations

import torch

from refitd.bench.gpu.quantizers import LARGE_SHAPE, _median_seconds

CHECKSUM_SHAPES = [(1,), (2,), (7, 2), (33, 64), (129, 257), (3, 5, 100), (4096, 1024)]


def bench_checksum(device: str = "cuda") -> list[dict]:
    """The Triton checksum (refitd.formats.grouped) vs the CPU checksum, bit for bit, on
    dtypes, shapes and strided views; then its GB/s (bytes read) on 1 GiB vs a copy, and
    vs the torch checksum on the device (refitd.executor.checksums, blocks of int64 ops)."""
    from refitd.executor.checksums import Checksummer, checksum
    from refitd.formats import grouped

    rows = []
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.uint8):
        for shape in CHECKSUM_SHAPES:
            x = _bits_as(shape, dtype, g).to(device)
            views = [x, x[..., 1:] if x.shape[-1] > 2 else x, x.t() if x.dim() == 2 else x]
            for v in views:
                fused = grouped.hash_landing([v]) is not None
                value = int(Checksummer()(v))  # the kernel when it takes v
                rows.append(
                    {
                        "name": f"check checksum {str(dtype).removeprefix('torch.')} "
                        f"{'kernel' if fused else 'torch'}",
                        "shape": tuple(v.shape),
                        "gbps": None,
                        "copy_gbps": None,
                        "ratio": None,
                        "bit_identical": value == checksum(v.cpu()),
                    }
                )
    x = torch.randn(LARGE_SHAPE, dtype=torch.bfloat16, device=device)
    copy_dst = torch.empty_like(x)
    copy_s = _median_seconds(lambda: copy_dst.copy_(x))
    copy_gbps = 2 * x.nbytes / copy_s / 1e9
    summer = Checksummer()
    torch_summer = Checksummer(block_words=1 << 24)  # block_words set: the torch path
    for name, fn in (
        ("checksum kernel 1 GiB (bytes read)", lambda: summer.tensor(x)),
        ("checksum torch ops 1 GiB (bytes read)", lambda: torch_summer.tensor(x)),
    ):
        seconds = _median_seconds(fn, iters=5, warmup=2)
        gbps = x.nbytes / seconds / 1e9
        rows.append(
            {
                "name": name,
                "shape": LARGE_SHAPE,
                "gbps": gbps,
                "copy_gbps": copy_gbps,
                "ratio": gbps / copy_gbps,
                "bit_identical": int(summer.tensor(x)) == int(torch_summer.tensor(x)),
            }
        )
    return rows


def _bits_as(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaN and Inf patterns included) viewed as dtype."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = torch.Size(shape).numel() * itemsize
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    return raw.view(dtype).reshape(shape)
