"""Version-safety rules of delta refits: every rule that sends a message dense, and the
refit-level density threshold with its probes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refitd.server.delta.policy import (
    UNKNOWN,
    DeltaMessageColumns,
    DeltaSettings,
    DestinationState,
    Landing,
    SenderBase,
    Timing,
    Why,
    decide,
    held_version,
    refit_mode,
)

PLAN = "plan-a"
ON = DeltaSettings(enabled=True, max_density=0.4, probe_every=4)


def dest(wid: str, version: int = 5, **kw: object) -> DestinationState:
    """A worker registered at t=1.0 into which version `version` landed by a refit of PLAN."""
    landed = Landing(version, 1.0, PLAN) if version >= 0 else None
    fields: dict[str, object] = {"registered_at": 1.0, "landed": landed}
    fields.update(kw)
    return DestinationState(wid, **fields)  # type: ignore[arg-type]


def columns(src: list[int], pairs: list[tuple[int, int]], capable: list[bool] | None = None):
    return DeltaMessageColumns(
        np.array(src, dtype=np.int64),
        np.array(capable if capable is not None else [True] * len(src)),
        np.array([m for m, _ in pairs], dtype=np.int64),
        np.array([w for _, w in pairs], dtype=np.int64),
    )


@pytest.mark.parametrize(
    ("state", "expect", "reason"),
    [
        (dest("w", 5), 5, "holds version 5"),
        (dest("w", -1), UNKNOWN, "new replica or restart"),
        (dest("w", 5, registered_at=2.0), UNKNOWN, "restarted since version 5"),
        (dest("w", 5, torn=True), UNKNOWN, "failed part-way"),
        (
            dest("w", landed=Landing(5, 1.0, PLAN, how="catch_up")),
            UNKNOWN,
            "came by catch_up",
        ),
        (dest("w", landed=Landing(5, 1.0, "plan-b")), UNKNOWN, "another plan"),
    ],
)
def test_held_version_rules(state: DestinationState, expect: int, reason: str) -> None:
    version, why = held_version(state, PLAN)
    assert version == expect
    assert reason in why


def test_all_hold_the_base_goes_delta() -> None:
    cols = columns([0, 0, 1], [(0, 0), (1, 1), (2, 0), (2, 1)])
    senders = {0: SenderBase(5, PLAN), 1: SenderBase(5, PLAN)}
    d = decide(ON, refit_mode(ON, []), PLAN, cols, senders, [dest("a"), dest("b")])
    assert d.delta.tolist() == [True, True, True]
    assert d.base_version == 5 and d.dense_workers == {}
    assert d.summary()["delta_messages"] == 3


def test_each_rule_sends_its_messages_dense() -> None:
    """Message i writes worker i (message 5 writes workers 0 and 6); each worker or sender
    breaks one rule, and only the messages touching it go dense, with that reason."""
    workers = [
        dest("ok"),
        dest("new", -1),
        dest("restarted", 5, registered_at=9.0),
        dest("torn", 5, torn=True),
        dest("old", 4),
        dest("ok2"),
        dest("caught-up", landed=Landing(5, 1.0, PLAN, how="catch_up")),
    ]
    src = [0, 0, 0, 0, 0, 0, 1, 0]
    pairs = [(i, i) for i in range(6)] + [(5, 6), (6, 0), (7, 5)]
    capable = [True] * 7 + [False]
    senders = {0: SenderBase(5, PLAN), 1: SenderBase(5, "plan-old")}
    d = decide(ON, refit_mode(ON, [0.04]), PLAN, columns(src, pairs, capable), senders, workers)
    assert d.why.tolist() == [
        Why.DELTA,
        Why.UNKNOWN_BASE,
        Why.UNKNOWN_BASE,
        Why.UNKNOWN_BASE,
        Why.OTHER_VERSION,
        Why.UNKNOWN_BASE,  # writes ok2 and the caught-up worker
        Why.NO_BASE,  # slot 1's base is from another plan
        Why.FORMAT,
    ]
    assert d.delta.tolist() == [True] + [False] * 7
    assert set(d.dense_workers) == {"new", "restarted", "torn", "old", "caught-up"}
    assert "version 4" in d.dense_workers["old"]
    s = d.summary()
    assert s["dense_why"] == {"no_base": 1, "format": 1, "unknown_base": 4, "other_version": 1}


def test_a_message_on_a_one_sided_link_goes_dense_as_link() -> None:
    """A mapped (or rdma) link writes the destination in place: its message goes dense,
    and the ledger says why, before any other rule."""
    cols = columns([0, 0, 1], [(0, 0), (1, 0), (2, 0)])
    cols = dataclasses.replace(cols, one_sided=np.array([False, True, True]))
    senders = {0: SenderBase(5, PLAN)}  # slot 1 has no base: link names it first
    d = decide(ON, refit_mode(ON, []), PLAN, cols, senders, [dest("a")])
    assert d.why.tolist() == [Why.DELTA, Why.LINK, Why.LINK]
    assert d.summary()["dense_why"] == {"link": 2}


def test_sender_without_base_goes_dense() -> None:
    cols = columns([0, 1], [(0, 0), (1, 0)])
    d = decide(ON, refit_mode(ON, []), PLAN, cols, {1: SenderBase(UNKNOWN, PLAN)}, [dest("a")])
    assert d.why.tolist() == [Why.NO_BASE, Why.NO_BASE]
    assert d.base_version == UNKNOWN


def test_new_plan_sends_everything_dense() -> None:
    cols = columns([0], [(0, 0)])
    d = decide(ON, refit_mode(ON, []), "plan-b", cols, {0: SenderBase(5, PLAN)}, [dest("a")])
    assert d.why.tolist() == [Why.NO_BASE]


def test_disabled_is_dense() -> None:
    off = DeltaSettings()
    mode = refit_mode(off, [])
    assert not mode.delta and mode.why == Why.DISABLED
    d = decide(off, mode, PLAN, columns([0], [(0, 0)]), {0: SenderBase(5, PLAN)}, [dest("a")])
    assert d.why.tolist() == [Why.DISABLED] and not d.delta.any()


def test_density_threshold_and_probes() -> None:
    """Above the threshold the next refits go dense until a probe measures again."""
    assert refit_mode(ON, [0.04]).delta
    assert refit_mode(ON, [0.6, 0.04]).delta  # the latest measurement counts
    dense = refit_mode(ON, [0.04, 0.6])
    assert not dense.delta and dense.why == Why.DENSITY and "0.6" in dense.reason
    assert not refit_mode(ON, [0.6, None, None]).delta  # measured 3 ago, probe_every 4
    assert refit_mode(ON, [0.6, None, None, None]).delta  # the probe
    assert refit_mode(ON, [0.4]).delta  # at the threshold is still allowed
    cols = columns([0], [(0, 0)])
    d = decide(ON, dense, PLAN, cols, {0: SenderBase(5, PLAN)}, [dest("a")])
    assert d.why.tolist() == [Why.DENSITY]


def test_many_messages_vectorised() -> None:
    """100k messages over 1,000 workers: one unknown worker sends exactly its messages dense."""
    n, nw = 100_000, 1000
    rng = np.random.default_rng(0)
    src = rng.integers(0, 64, n)
    pw = rng.integers(0, nw, n)
    workers = [dest(f"w{i}") for i in range(nw)]
    workers[17] = dest("w17", 5, torn=True)
    senders = {s: SenderBase(5, PLAN) for s in range(64)}
    cols = columns(src.tolist(), list(zip(range(n), pw.tolist(), strict=True)))
    d = decide(ON, refit_mode(ON, []), PLAN, cols, senders, workers)
    assert np.array_equal(~d.delta, pw == 17)
    assert list(d.dense_workers) == ["w17"]


def test_ledger_tracks_landings_failures_and_sender_promotion() -> None:
    from refitd.server.delta.policy import DeltaLedger

    led = DeltaLedger.empty()
    led.committed(3, PLAN, {"a": 1.0, "b": 1.0})
    assert held_version(led.destination("a", 1.0), PLAN)[0] == 3
    assert held_version(led.destination("a", 2.0), PLAN)[0] == UNKNOWN  # restarted
    assert held_version(led.destination("c", 1.0), PLAN)[0] == UNKNOWN  # new replica
    led.wrote_and_failed(["b"])
    assert held_version(led.destination("b", 1.0), PLAN)[0] == UNKNOWN
    led.committed(4, PLAN, {"b": 1.0})
    assert held_version(led.destination("b", 1.0), PLAN)[0] == 4
    led.committed(4, PLAN, {"c": 5.0}, how="catch_up")
    assert held_version(led.destination("c", 5.0), PLAN)[0] == UNKNOWN
    # slot 0 sent 4 (pending) over base 3; slot 1 sent 5, which failed; slot 2 already at 4
    led.reported(0, 3, 4, PLAN)
    led.reported(1, 3, 5, PLAN)
    led.reported(2, 4, UNKNOWN, "plan-old")
    got = led.senders(4, PLAN)
    assert got[0] == SenderBase(4, PLAN)
    assert got[1].version == UNKNOWN
    assert got[2].version == 4 and got[2].plan_key == ""  # base from another plan
    led.measured(0.04)
    led.measured(None)
    assert led.densities == [0.04, None]


def test_slower_than_dense_goes_dense_until_a_probe() -> None:
    """Never slower than dense: after a delta refit that took longer than the dense refit
    before it, refits go dense (reason recorded) until probe_every refits later."""
    fast_link = [Timing(False, 0.3), Timing(True, 0.6)]
    slow = refit_mode(ON, [0.04], fast_link)
    assert not slow.delta and slow.why == Why.SLOWER and "0.6" in slow.reason
    assert not refit_mode(ON, [0.04], [*fast_link, Timing(False, 0.3)]).delta
    assert refit_mode(ON, [0.04], [*fast_link, *[Timing(False, 0.3)] * 3]).delta  # the probe
    assert refit_mode(ON, [0.04], [Timing(False, 0.3), Timing(True, 0.1)]).delta  # faster
    assert refit_mode(ON, [0.04], [Timing(True, 0.6)]).delta  # no dense refit to compare
    off = dataclasses.replace(ON, speed_rule=False)  # the delta_speed_rule setting
    assert refit_mode(off, [0.04], fast_link).delta
