"""Tile choice on the device: the quantizers' fastest config for a shape, timed once.

Every config of a kernel writes the same bytes (the gpu tests and the benchmark check each
bit for bit), so which one runs is a matter of speed only, and the fastest differs between
devices (an H100 and an H200 differ in bandwidth and SM count) and shapes. A `TileTuner`
times the candidates on the caller's own tensors the first time a (kernel, dtype, shape)
appears, keeps the winner and its timings, and hands out the winner afterwards. The
object that owns the launches owns the tuner (a grouped landing, a benchmark), so the
choice lives as long as the program it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# candidates per kernel; the first is the default where no tuning runs
_TILES = ((8, 512, 4), (16, 256, 8), (32, 256, 8), (16, 512, 8), (4, 1024, 4), (8, 1024, 8))
CANDIDATES: dict[str, tuple[dict, ...]] = {
    "mxfp8": tuple({"block_m": m, "block_c": c, "num_warps": w} for m, c, w in _TILES[:5]),
    "fp8_block": tuple(
        {"sub_r": r, "num_warps": w} for r, w in ((32, 8), (16, 4), (32, 4), (64, 8))
    ),
    "nvfp4": tuple({"block_m": m, "block_c": c, "num_warps": w} for m, c, w in _TILES),
}


def median_gpu_seconds(launch: Callable[[], object], iters: int = 10, warmup: int = 1) -> float:
    """Median GPU time of `iters` launches on the current stream, timed with CUDA events,
    after `warmup` launches (the first compiles a Triton config)."""
    for _ in range(warmup):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@dataclass
class TileTuner:
    """The fastest config per (kernel, source dtype, shape), timed on first use (CUDA)."""

    iters: int = 3
    candidates: dict[str, tuple[dict, ...]] = field(default_factory=lambda: dict(CANDIDATES))
    picks: dict[tuple, dict] = field(default_factory=dict)
    timings: dict[tuple, list[tuple[dict, float]]] = field(default_factory=dict)

    def choose(self, kernel: str, x: torch.Tensor, launch: Callable[[dict], object]) -> dict:
        """The config for `kernel` on a source like x: the kept pick, else the fastest of
        self.candidates[kernel], each launched through `launch(config)` (which must write only
        the caller's own outputs: every candidate writes the same bytes)."""
        key = (kernel, x.dtype, tuple(x.shape))
        pick = self.picks.get(key)
        if pick is not None:
            return pick
        candidates = self.candidates[kernel]
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return candidates[0]
        with torch.cuda.device(x.device):
            rows = [(c, median_gpu_seconds(lambda c=c: launch(c), self.iters)) for c in candidates]
        self.timings[key] = rows
        self.picks[key] = min(rows, key=lambda r: r[1])[0]
        return self.picks[key]

    def report(self) -> list[dict]:
        """The timings kept: one row per (kernel, dtype, shape) and config, GB/s of the
        source read."""
        out = []
        for (kernel, dtype, shape), rows in self.timings.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            for config, seconds in rows:
                out.append(
                    {
                        "kernel": kernel,
                        "dtype": str(dtype).removeprefix("torch."),
                        "shape": shape,
                        "config": config,
                        "ms": round(seconds * 1e3, 4),
                        "src_gbps": round(nbytes / seconds / 1e9, 1),
                        "picked": config == self.picks[(kernel, dtype, shape)],
                    }
                )
        return out


@dataclass
class _Launch:
    kernel: str
    src: torch.Tensor
    call: Callable[..., object]  # call(**config) quantizes src into its outputs
    config: dict


@dataclass
class DirectLaunches:
    """Regions that take a per-tensor kernel launch of their own, each with its config:
    the first of CANDIDATES until `tune` times the candidates on the regions themselves."""

    launches: list[_Launch] = field(default_factory=list)
    tuned: bool = False
    # per distinct (kernel, dtype, shape): the config its launches run with, and whether a
    # tuner timed it on this device (else the default); filled by `tune`
    chosen: list[dict] = field(default_factory=list)

    def add(self, kernel: str, src: torch.Tensor, call: Callable[..., object]) -> None:
        self.launches.append(_Launch(kernel, src, call, CANDIDATES[kernel][0]))

    def tune(self, tuner: TileTuner | None) -> None:
        """Pick each region's config (once; outside a graph capture: it synchronizes);
        without a tuner, keep the defaults."""
        if self.tuned or tuner is None:
            return
        for ln in self.launches:
            ln.config = tuner.choose(ln.kernel, ln.src, lambda c, ln=ln: ln.call(**c))
        self.tuned = True
        seen: set[tuple] = set()
        for ln in self.launches:
            key = (ln.kernel, ln.src.dtype, tuple(ln.src.shape))
            if key not in seen:
                seen.add(key)
                self.chosen.append(
                    {
                        "kernel": ln.kernel,
                        "dtype": str(ln.src.dtype).removeprefix("torch."),
                        "shape": key[2],
                        "config": ln.config,
                        "timed": key in tuner.timings,
                    }
                )

    def run(self) -> None:
        for ln in self.launches:
            ln.call(**ln.config)
