"""The plan_schedule setting: every settings source reaches it, and the controller's plans
use it: `auto` plans serial rounds without relays for nccl and lanes with relays for gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from refitd.cli.main import build_parser
from refitd.config import load_settings, settings_from_args
from refitd.plan.layout import TensorSpec
from refitd.plan.layouts import make_spec, megatron_layout
from refitd.server.controller import Controller
from refitd.server.planning import make_digest, make_plan


def _replicas(pool: str, ranks: int, slot: int) -> list[TensorSpec]:
    """`ranks` replicas of two whole [64, 32] tensors, one per slot from `slot` on."""
    return [
        make_spec(
            model="m",
            pool=pool,
            rank=r,
            slot=slot + r,
            name=name,
            global_shape=(64, 32),
            dtype="float32",
            layout=megatron_layout((64, 32), label=name),
        )
        for r in range(ranks)
        for name in ("a", "b")
    ]


def test_every_settings_source_reaches_plan_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REFITD_PLAN_SCHEDULE", raising=False)
    monkeypatch.delenv("REFITD_CONFIG", raising=False)
    assert load_settings(None).plan_schedule == "auto"
    toml = tmp_path / "refitd.toml"
    toml.write_text('plan_schedule = "serial"\n')
    assert load_settings(toml).plan_schedule == "serial"
    monkeypatch.setenv("REFITD_PLAN_SCHEDULE", "lanes")
    assert load_settings(toml).plan_schedule == "lanes"  # the environment beats the file
    argv = ["serve", "--plan-schedule", "serial"]  # a flag beats the environment
    assert settings_from_args(build_parser(argv).parse_args(argv)).plan_schedule == "serial"
    with pytest.raises(ValueError, match="plan_schedule must be auto, lanes or serial"):
        load_settings(None, plan_schedule="fast")


@pytest.mark.parametrize(
    ("transport", "schedule", "relay", "want"),
    [
        ("nccl", "auto", True, ("serial", False)),
        ("gloo", "auto", True, ("lanes", True)),
        ("gloo", "auto", False, ("lanes", False)),
        ("gloo", "serial", True, ("serial", True)),
        ("nccl", "lanes", True, ("lanes", True)),
    ],
)
def test_the_controllers_plans_follow_plan_schedule(
    tmp_path: Path, transport: str, schedule: str, relay: bool, want: tuple[str, bool]
) -> None:
    settings = load_settings(
        None,
        host="127.0.0.1",
        grpc_port=0,
        http_port=0,
        data_dir=tmp_path,
        transport=transport,
        plan_schedule=schedule,
        relay=relay,
    )
    ctl = Controller(settings).start()
    try:
        options = ctl.refits.plan_options
        # four destination replicas: relays have something to forward
        src = _replicas("train", 1, 0)
        dst = _replicas("inf", 4, 10)
        plan = make_plan("m", 1, src, dst, options).plan
        assert (plan.config.schedule, plan.config.relay) == want
        assert (plan.stats.relay_bytes > 0) == want[1]
        assert plan.digest == make_digest("m", src, dst, options)
    finally:
        ctl.stop()


@pytest.mark.parametrize("chain", [False, True])
def test_the_controllers_plans_follow_relay_chain(tmp_path: Path, chain: bool) -> None:
    """relay_chain reaches the controller's plans: two pools of replicas, and with the
    chain only the first registered pool's ranks forward."""
    argv = ["serve", "--relay-chain" if chain else "--no-relay-chain"]
    assert settings_from_args(build_parser(argv).parse_args(argv)).relay_chain is chain
    settings = load_settings(
        None, host="127.0.0.1", grpc_port=0, http_port=0, data_dir=tmp_path, relay_chain=chain
    )
    ctl = Controller(settings).start()
    try:
        src = _replicas("train", 1, 0)
        dst = _replicas("inf-a", 1, 10) + _replicas("inf-b", 1, 20)
        plan = make_plan("m", 1, src, dst, ctl.refits.plan_options).plan
        assert plan.config.relay_chain is chain and plan.stats.relay_bytes > 0
        relay_senders = {
            slot
            for slot in plan.slots()
            for m in plan.program(slot).sends
            if any(c.src_tensor >= len(src) for c in m.copies)
        }
        assert relay_senders == ({10} if chain else {10, 20})
    finally:
        ctl.stop()
