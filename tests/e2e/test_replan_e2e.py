"""Membership changes that keep every layout reuse the plan; a new replica catches up.

Real `refitd serve` (controller, agent, transfer processes), a trainer rank in this process
and inference ranks as their own processes (_inference_worker.py), which compare every
tensor with the generator's weights of the committed version ("commit <v> ok"). The
controller's counters are read from /metrics: plans built (by kind) and programs sent.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from refitd.demo.run import Daemon

from .test_faults_e2e import FAST, Trainer, Worker, status, wait_subscribed

pytestmark = pytest.mark.slow


def counters(d: Daemon, model: str) -> dict[str, float]:
    """refitd_plans_built_total per kind ("plans_<kind>") and refitd_programs_sent_total
    ("programs_sent") of `model`, from the controller's /metrics. "plans_refit" counts the
    refits' plans whether the refit built it or the controller built it ahead."""
    url = f"http://127.0.0.1:{d.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {"plans_refit": 0.0, "plans_catch_up": 0.0, "programs_sent": 0.0}
    ahead = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model") != model:
                continue
            if s.name == "refitd_plans_built_total" and s.labels["kind"] == "ahead":
                ahead = s.value
            elif s.name == "refitd_plans_built_total":
                out[f"plans_{s.labels['kind']}"] = s.value
            elif s.name == "refitd_programs_sent_total":
                out["programs_sent"] = s.value
    out["plans_refit"] += ahead
    return out


def epoch(d: Daemon, model: str) -> int:
    return next(m["epoch"] for m in status(d.address)["models"] if m["name"] == model)


def test_restarted_inference_rank_reuses_the_plan(tmp_path: Path) -> None:
    """An inference rank is killed (-9) and started again with new memory: the plan is
    reused (no plan built), only its slot gets its program again (the trainer's slot
    keeps its own), and the next refit lands bit for bit in the new memory."""
    model = "replan-restart"
    d = Daemon(cpu_slots=2, extra_args=FAST)
    d.start(ready_timeout_s=180)  # a loaded test machine starts it slowly
    w = w2 = None
    trainer = None
    try:
        for v in (1, 2, 3):  # the pause gates: open
            (tmp_path / str(v)).touch()
        w = Worker(d.address, model, tmp_path, "infer", "cpu:1")
        trainer = Trainer(d.address, model)
        w.expect("ready")
        wait_subscribed(d.address, model)
        assert (r := trainer.refit(1))[0] == "committed", r
        assert w.expect("commit 1") == "commit 1 ok"
        before = counters(d, model)
        assert before["plans_refit"] == 1 and before["programs_sent"] == 2  # two slots
        e = epoch(d, model)
        w.kill()
        w2 = Worker(d.address, model, tmp_path, "infer", "cpu:1")
        w2.expect("ready")
        wait_subscribed(d.address, model)
        assert epoch(d, model) > e  # a membership change
        assert (r := trainer.refit(2))[0] == "committed", r
        assert w2.expect("commit 2") == "commit 2 ok"
        after = counters(d, model)
        assert after["plans_refit"] == before["plans_refit"]  # the plan was reused
        assert after["plans_catch_up"] == 0
        assert after["programs_sent"] == before["programs_sent"] + 1  # the restarted slot only
        assert (r := trainer.refit(3))[0] == "committed", r  # nothing to load: a dict compare
        assert w2.expect("commit 3") == "commit 3 ok"
        assert counters(d, model) == after
    finally:
        if trainer is not None:
            trainer.client.close()
        for x in (w, w2):
            if x is not None and x.proc.poll() is None:
                x.kill()
        d.stop()


def test_added_replica_catches_up_then_takes_part(tmp_path: Path) -> None:
    """A second dp replica (a new pool of the same layout on another slot) joins a model
    whose trainer has moved on: it is caught up to the committed version from the first
    replica (bit for bit), then the next refit lands in both replicas (bit for bit)."""
    model = "replan-replica"
    d = Daemon(cpu_slots=3, extra_args=FAST)
    d.start(ready_timeout_s=180)  # a loaded test machine starts it slowly
    a = b = None
    trainer = None
    try:
        for v in (1, 2, 3):  # the pause gates: open
            (tmp_path / str(v)).touch()
        a = Worker(d.address, model, tmp_path, "infer-a", "cpu:1")
        trainer = Trainer(d.address, model)
        a.expect("ready")
        wait_subscribed(d.address, model)
        assert (r := trainer.refit(1))[0] == "committed", r
        assert a.expect("commit 1") == "commit 1 ok"
        before = counters(d, model)
        for s in trainer.shards:  # the next training step: the trainer no longer holds v1
            trainer.gen.fill(trainer.src[s.name], s, 2)
        b = Worker(d.address, model, tmp_path, "infer-b", "cpu:2")
        assert b.expect("paused 1", timeout_s=60) == "paused 1"
        assert b.expect("commit 1", timeout_s=60) == "commit 1 ok"
        caught = [r for r in status(d.address)["refits"] if r.get("catch_up")]
        assert caught and caught[0]["state"] == "committed" and caught[0]["version"] == 1
        assert caught[0]["catch_up_plan"] == "twin"  # the same layout: copied rank to rank
        assert counters(d, model)["plans_catch_up"] == before["plans_catch_up"] + 1
        assert (r := trainer.refit(2))[0] == "committed", r
        assert a.expect("commit 2") == "commit 2 ok"
        assert b.expect("commit 2") == "commit 2 ok"
        after = counters(d, model)
        assert after["plans_refit"] == before["plans_refit"] + 1  # a new pool: a new layout
    finally:
        if trainer is not None:
            trainer.client.close()
        for x in (a, b):
            if x is not None and x.proc.poll() is None:
                x.kill()
        d.stop()
