"""One run of representative kill -9 cases of `refitd bench faults` on a real cluster.

Each case kills a real process (trainer rank, transfer process, node agent, controller) at
a refit phase and checks the suite's outcome: the kill landed in that phase, no surviving
call hung past its timeout, a trainer rank killed before it asks failed the refit at its
lease (not at the barrier timeout), every served version was bit for bit, nothing was lost
across a controller restart, every paused rank was told how its refit ended, and a refit
committed after the restart (its time is the bench's business: `refitd bench faults`,
target under 10 s).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refitd.bench.faults.suite import FaultSuite

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def suite() -> Iterator[FaultSuite]:
    s = FaultSuite(mb=4.0)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize(
    "role,phase",
    [
        ("trainer", "before"),
        ("trainer", "transfer"),
        ("transfer", "transfer"),
        ("inference", "commit"),
        ("agent", "before"),
        ("controller", "transfer"),
        ("controller", "commit"),
    ],
)
def test_kill_member_at_phase(suite: FaultSuite, role: str, phase: str) -> None:
    r = suite.run(role, phase)
    assert r.hit, f"the kill missed the {phase} phase: {r.notes}"
    assert r.hangs == 0, r.notes
    assert r.torn == 0, r.notes
    assert r.untold == 0, r.notes
    assert r.late == 0, r.notes
    assert r.lost == 0, r.notes
    assert r.recovery_s is not None, r.notes
    assert suite.cluster is not None and not suite.cluster.mismatches


def test_kill_trainer_mid_delta_refit() -> None:
    """The delta case: with --delta-refits and sparse successive versions, a trainer rank
    killed while a refit that sends deltas transfers leaves nothing torn or lost, and the
    refits after its restart land bit for bit (deltas are checked like any refit)."""
    s = FaultSuite(mb=4.0, delta=True)
    try:
        r = s.run("trainer", "transfer")
    finally:
        s.close()
    assert r.delta, f"the killed refit did not send deltas: {r.notes}"
    assert r.hit, f"the kill missed the transfer phase: {r.notes}"
    assert (r.hangs, r.torn, r.untold, r.late, r.lost) == (0, 0, 0, 0, 0), r.notes
    assert r.recovery_s is not None, r.notes
