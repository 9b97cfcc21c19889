"""The status page in a real browser (Debian's headless Chromium driven by playwright).

8 workers: a 4-rank trainer refits two inference pools of 2 ranks through the daemon; the
page shows the committed version, ranks per served version, the refit timeline by phase,
throughput and the per-slot traffic of the plan, and the per-rank table behind its filter.
1,024 metadata-only workers (registered over real gRPC on 16 light agents of 64 slots,
memory handles never mapped): the summary stays a few lines per pool (a missing rank is
listed, not 1,024 rows), and the plan picture shows the busiest slots. Screenshots go to
artifacts/status_page_8.png and artifacts/status_page_1024.png.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("REFITD_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
MODEL = "browser-gpt"
META = "meta-1024"
META_HOST = "meta-host"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    # long leases: the metadata-only workers never heartbeat
    d = Daemon(cpu_slots=4, extra_args=["--log-level", "info", "--heartbeat-timeout-s", "600"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def sync_api() -> Any:
    api = pytest.importorskip("playwright.sync_api")
    if shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    return api


def _subscribed(c: InferenceClient) -> None:
    hello = threading.Event()
    c.on_update(lambda event: hello.set() if event.kind == "hello" else None)
    assert hello.wait(30), "no subscription"


def _shoot(sync_api: Any, url: str, shot: Path, check: Any) -> str:
    """Open the page, run `check(page)`, save a full-page screenshot; the body text."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, timeout=30_000)
            check(page)
            page.screenshot(path=str(shot), full_page=True)
            text = page.inner_text("body")
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    return text


def test_status_page_at_8_workers(daemon: Daemon, sync_api: Any) -> None:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    trainers = [
        TrainerClient(daemon.address, MODEL, rank=r, pool_size=4, device=f"cpu:{r}")
        for r in range(4)
    ]
    infers, dst = [], []
    for pool in ("infer", "infer-b"):
        for r in range(2):
            c = InferenceClient(
                daemon.address, MODEL, pool, rank=r, pool_size=2, device=f"cpu:{r + 2}"
            )
            t = torch.zeros(32, 32, dtype=torch.bfloat16)
            c.register({"w": Placed(t, (64, 32), [((32 * r, 0), (32, 32), (0, 0))])})
            _subscribed(c)
            infers.append(c)
            dst.append((r, t))
    try:
        for r, t in enumerate(trainers):
            t.register(
                {
                    "w": Placed(
                        full[16 * r : 16 * r + 16].clone(),
                        (64, 32),
                        [((16 * r, 0), (16, 32), (0, 0))],
                    )
                }
            )
        with ThreadPoolExecutor(4) as ex:
            for v in (1, 2, 3):
                refit = lambda t, v=v: t.refit(v, wait="committed", timeout=60).state  # noqa: E731
                states = list(ex.map(refit, trainers))
                assert states == ["committed"] * 4
        for r, t in dst:
            assert torch.equal(t, full[32 * r : 32 * r + 32])

        def check(page: Any) -> None:
            expect = sync_api.expect
            models = page.locator("#models")
            expect(models).to_contain_text(MODEL, timeout=15_000)
            expect(models).to_contain_text("committed version 3", timeout=15_000)
            expect(models).to_contain_text("v3: 2", timeout=15_000)  # ranks per served version
            expect(models).to_contain_text("Bottleneck: slot", timeout=15_000)
            expect(page.locator("#timeline svg rect").first).to_be_visible(timeout=15_000)
            expect(page.locator("#rate svg circle")).to_have_count(3, timeout=15_000)
            expect(page.locator("#refits")).to_contain_text("committed", timeout=15_000)
            page.click("#rankdetails summary")
            page.fill("#filter", "infer-b")
            expect(page.locator("#rankcount")).to_have_text("2 matching ranks", timeout=15_000)
            page.fill("#filter", "")
            expect(page.locator("#rankcount")).to_have_text("8 matching ranks", timeout=15_000)

        text = _shoot(sync_api, daemon.status_url, ARTIFACTS / "status_page_8.png", check)
        assert "infer-b" in text and "trainer" in text and "transfer" in text
    finally:
        for c in [*infers, *trainers]:
            c.close()


def _drain(stream: Any) -> None:
    """A light agent's slot: takes commands, never answers (no refit of this model)."""
    with contextlib.suppress(grpc.RpcError):
        for _ in stream:
            pass


def _light_agents(address: str, n_slots: int, per_agent: int = 64) -> list[Any]:
    """Agents over real gRPC whose slots only hold command streams open (metadata only)."""
    ch = grpc.insecure_channel(address)
    stub = pbg.AgentControlStub(ch)
    streams = []
    for a in range(0, n_slots, per_agent):
        devices = [f"cpu:{i}" for i in range(a, min(n_slots, a + per_agent))]
        resp = stub.RegisterAgent(
            pb.RegisterAgentRequest(
                host=META_HOST, slots=[pb.SlotInfo(device=d) for d in devices], pid=os.getpid()
            ),
            timeout=30,
        )
        s = stub.Commands(pb.AgentStreamRequest(agent_id=resp.agent_id))
        threading.Thread(target=_drain, args=(s,), daemon=True).start()
        streams.append(s)
    return [ch, *streams]


def _meta_worker(
    pool: str, role: int, rank: int, size: int, device: int
) -> pb.RegisterWorkerRequest:
    rows = 3072 // size
    return pb.RegisterWorkerRequest(
        model=META, pool=pool, role=role, rank=rank, pool_size=size, host=META_HOST,
        device=f"cpu:{device}", pid=os.getpid(),
        tensors=[pb.TensorRegistration(
            name="w", canonical="w", global_shape=[3072, 64], dtype="bfloat16", local_shape=[rows, 64],
            boxes=[pb.Box(offset=[rank * rows, 0], shape=[rows, 64], local_offset=[0, 0])],
            memory=f"meta:{pool}:{rank}".encode(),
        )],
    )  # fmt: skip


def test_status_page_at_1024_metadata_workers(daemon: Daemon, sync_api: Any) -> None:
    handles = _light_agents(daemon.address, 1024)
    ch = grpc.insecure_channel(daemon.address)
    stub = pbg.RefitStub(ch)
    reqs = [_meta_worker("trainer", pb.ROLE_SOURCE, r, 768, r) for r in range(768)]
    for k, pool in enumerate(("infer-0", "infer-1")):
        reqs += [
            _meta_worker(pool, pb.ROLE_DESTINATION, r, 128, 768 + 128 * k + r) for r in range(128)
        ]
    try:
        with ThreadPoolExecutor(4) as ex:
            ids = list(ex.map(lambda q: stub.RegisterWorker(q, timeout=120).worker_id, reqs))
        # explaining builds (and caches) the plan of the registered layout: the traffic picture
        base = daemon.status_url.rstrip("/")
        with httpx.Client(base_url=base, timeout=120) as http:
            ex_doc = http.get(
                "/v1/explain", params={"model": META, "tensor": "w", "pool": "infer-0", "rank": 5}
            ).json()
            assert sorted(f["source"] for f in ex_doc["shards"][0]["feeds"]) == [
                f"trainer:{r}" for r in range(30, 36)
            ]
            # then one rank leaves: listed as missing, not hidden among 1,024 rows
            stub.UnregisterWorker(
                pb.UnregisterWorkerRequest(worker_id=ids[768 + 128 + 77]), timeout=30
            )
            doc = http.get("/v1/status", params={"model": META, "ranks": "false"}).json()
        pools = {p["name"]: p["summary"] for p in doc["models"][0]["pools"]}
        assert pools["trainer"]["live"] == 768 and pools["infer-1"]["dead"] == "77"
        assert len(doc["models"][0]["plan"]["slots"]) == 1024

        def check(page: Any) -> None:
            expect = sync_api.expect
            models = page.locator("#models")
            expect(models).to_contain_text(META, timeout=30_000)
            expect(models).to_contain_text("768/768", timeout=30_000)
            expect(models).to_contain_text("1: 77", timeout=30_000)
            expect(models).to_contain_text("24 busiest receivers of 1024 slots", timeout=30_000)
            expect(page.locator("#fleet")).to_contain_text("1028", timeout=30_000)
            page.click("#rankdetails summary")
            page.fill("#filter", "meta-1024 infer-1 rank 12")
            expect(page.locator("#rankcount")).to_have_text("1 matching ranks", timeout=30_000)
            page.fill("#filter", "infer-0")
            expect(page.locator("#rankcount")).to_have_text("128 matching ranks", timeout=30_000)
            page.fill("#filter", "")
            expect(page.locator("#rankcount")).to_contain_text(
                "showing 500 of 1023", timeout=30_000
            )
            page.fill("#filter", "infer-1 12")

        _shoot(sync_api, daemon.status_url, ARTIFACTS / "status_page_1024.png", check)
    finally:
        ch.close()
        for h in handles[1:]:
            h.cancel()
        handles[0].close()
