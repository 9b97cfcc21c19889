"""The status page in a real browser: Debian's headless Chromium driven by playwright shows
the model, its committed version and the last refit after a refit through the daemon; a
screenshot is saved under artifacts/."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, extra_args=["--log-level", "info"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_status_page_shows_models_versions_and_last_refit(daemon: Daemon) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    if shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    g = torch.Generator().manual_seed(3)
    src = {"w": torch.randn(64, 32, generator=g).to(torch.bfloat16)}
    dst = {"w": torch.zeros(64, 32, dtype=torch.bfloat16)}
    trainer = TrainerClient(daemon.address, MODEL, rank=0, pool_size=1, device="cpu:0")
    infer = InferenceClient(daemon.address, MODEL, "infer", rank=0, pool_size=1, device="cpu:1")
    try:
        trainer.register(src)
        infer.register({"w": Placed(dst["w"])})
        hello = threading.Event()
        infer.on_update(lambda event: hello.set() if event.kind == "hello" else None)
        assert hello.wait(30), "no subscription"
        for v in (1, 2):
            assert trainer.refit(v, wait="committed", timeout=60).state == "committed"
        assert torch.equal(dst["w"], src["w"])

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "status_page.png"
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(daemon.status_url, timeout=30_000)
                models = page.locator("#models")
                sync_api.expect(models).to_contain_text(MODEL, timeout=15_000)
                sync_api.expect(models).to_contain_text("committed version 2", timeout=15_000)
                refits = page.locator("#refits")
                sync_api.expect(refits).to_contain_text(MODEL, timeout=15_000)
                sync_api.expect(refits).to_contain_text("committed", timeout=15_000)
                page.screenshot(path=str(shot), full_page=True)
                text = page.inner_text("body")
            finally:
                browser.close()
        assert shot.stat().st_size > 10_000
        assert "infer" in text and "trainer" in text
    finally:
        infer.close()
        trainer.close()
