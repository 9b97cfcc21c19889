"""Dtype casts through `refitd serve --allow-dtype-cast`: a BF16 trainer refits an FP32
inference pool and an FP32 trainer tensor lands in BF16, bit for bit against torch's own
`.to(dtype)` of the source (the default, casts off, is tested in
tests/server/test_dtype_cast_setting.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from refitd.client import InferenceClient, Placed, RefitError, TrainerClient, VersionEvent
from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

ROWS = 2  # trainer ranks, each holding half of the rows of every tensor
SHAPES = {
    "w": ((16, 24), torch.bfloat16, torch.float32),
    "v": ((8, 40), torch.float32, torch.bfloat16),
}


def global_weights(version: int) -> dict[str, torch.Tensor]:
    """Source values over many binades, subnormals and infinities included, so rounding
    to nearest even and the range limits of the narrower dtype are both exercised."""
    g = torch.Generator().manual_seed(500 + version)
    out = {}
    for name, (shape, src_dtype, _) in SHAPES.items():
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x *= torch.exp2(torch.randint(-140, 130, shape, generator=g).double())
        x.view(-1)[:4] = torch.tensor([float("inf"), -float("inf"), 1e-45, -0.0])
        out[name] = x.to(src_dtype)
    return out


@pytest.fixture(scope="module")
def casting() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, extra_args=["--allow-dtype-cast", "--pause-timeout-s", "20"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


class Commits:
    """The COMMIT versions an inference client saw, waited on as a condition."""

    def __init__(self, client: InferenceClient) -> None:
        self._cond = threading.Condition()
        self.versions: list[int] = []
        self.hello = False
        client.on_update(self._on)

    def _on(self, event: VersionEvent) -> None:
        with self._cond:
            if event.kind == "hello":
                self.hello = True
            elif event.kind == "commit":
                self.versions.append(event.version)
            self._cond.notify_all()

    def wait(self, pred: object, timeout_s: float = 30.0) -> None:
        with self._cond:
            assert self._cond.wait_for(pred, timeout_s), "timed out"  # type: ignore[arg-type]


def _refit_all(trainers: list[TrainerClient], version: int) -> list[object]:
    out: list[object] = [None] * len(trainers)

    def ask(r: int) -> None:
        try:
            out[r] = trainers[r].refit(version, wait="committed", timeout=60)
        except RefitError as e:
            out[r] = e

    threads = [threading.Thread(target=ask, args=(r,)) for r in range(len(trainers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


def _cluster(
    address: str, model: str
) -> tuple[list[TrainerClient], list[dict[str, torch.Tensor]], InferenceClient, dict]:
    """ROWS trainer ranks (row halves, source dtypes) and one inference rank holding whole
    tensors in the other dtype."""
    first = global_weights(1)
    shards = [
        {n: torch.chunk(t, ROWS, 0)[r].clone() for n, t in first.items()} for r in range(ROWS)
    ]
    trainers = []
    for r in range(ROWS):
        t = TrainerClient(address, model, rank=r, pool_size=ROWS, device=f"cpu:{r}")
        rows = SHAPES["w"][0][0] // ROWS, SHAPES["v"][0][0] // ROWS
        t.register(
            {
                n: Placed(s, SHAPES[n][0], [((r * k, 0), tuple(s.shape), (0, 0))])
                for (n, s), k in zip(shards[r].items(), rows, strict=True)
            }
        )
        trainers.append(t)
    dst = {n: torch.zeros(shape, dtype=d) for n, (shape, _, d) in SHAPES.items()}
    infer = InferenceClient(address, model, "infer", rank=0, pool_size=1, device="cpu:1")
    infer.register(dst)
    return trainers, shards, infer, dst


def test_dtype_cast_lands_like_torch_to(casting: Daemon) -> None:
    trainers, shards, infer, dst = _cluster(casting.address, "cast")
    commits = Commits(infer)
    try:
        commits.wait(lambda: commits.hello)
        for version in (1, 2):
            weights = global_weights(version)
            for r in range(ROWS):
                for n, t in weights.items():
                    shards[r][n].copy_(torch.chunk(t, ROWS, 0)[r])  # in place, as a step does
            got = _refit_all(trainers, version)
            assert all(getattr(g, "state", None) == "committed" for g in got), got
            commits.wait(lambda v=version: v in commits.versions)
            for n, t in weights.items():
                want = t.to(SHAPES[n][2])
                assert dst[n].dtype == want.dtype
                bits = torch.int16 if want.element_size() == 2 else torch.int32
                assert torch.equal(dst[n].view(bits), want.view(bits)), n
    finally:
        infer.close()
        for t in trainers:
            t.close()
