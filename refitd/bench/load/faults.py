"""`refitd bench load --faults`: kill -9 a tenth of the metadata workers and one agent in
the middle of a refit of the large model, then bring them back.

The metadata peers run as three processes: the survivors (nine tenths of the workers and
all agents but the last), the victims (the other tenth of the workers: every tenth
registration, trainer and inference ranks alike) and one agent. Their light agents report
an execute done only after `--hold-s`, so a refit stays in its transfer long enough to be
hit. The scenario: a refit that commits; a refit during whose transfer the victims and the
agent are killed (it must fail naming them, and end: no hang); the victims started again
(they register the same ranks, the agent the same slots); the next refit, which must
commit. Counted: hangs (a refit not ended, or a Refit call not answered, within its
timeouts), torn (an inference rank told COMMIT of the refit that failed), untold (a
surviving inference rank paused by it and never told how it ended), lost (workers missing
or the committed version wrong at the end), and the recovery: seconds from the victims'
restart to the next refit committed. Heartbeats refused to the survivors are counted by
the bench as in every run.
"""

from __future__ import annotations

import time
from typing import Any

from refitd.bench.load.meta import META_MODEL, PeerRole, slots_per_agent
from refitd.bench.load.peers import Peers

TENTHS = 10
REFIT_TIMEOUT_S = 120.0


def fault_roles(workers: int, hold_s: float) -> list[PeerRole]:
    """Survivors, victims (a tenth of the workers) and one agent (the last)."""
    last = -(-workers // slots_per_agent(workers)) - 1
    return [
        PeerRole("survivors", tuple(range(TENTHS - 1)), TENTHS, tuple(range(last)), True, hold_s),
        PeerRole("victims", (TENTHS - 1,), TENTHS, (), True, hold_s),
        PeerRole("agent", (), TENTHS, (last,), True, hold_s),
    ]


def run_faults(ctl: Any, peers: Peers, roles: list[PeerRole], workers: int, me: Any) -> dict:
    """The scenario of the module docstring; its figures for the bench's JSON line."""
    from refitd._proto import refitd_pb2 as pb

    out: dict[str, Any] = {"faults_killed_workers": _count(roles[1], workers)}
    first = _refit(ctl, peers, roles, 1)
    out["faults_refit_before"] = first["state"]
    out["faults_refit_before_s"] = first["seconds"]
    rss_before = me.memory_info().rss
    # the refit hit: the kills land in its transfer
    _ask(peers, roles, 2)
    _await_state(ctl, 2, pb.REFIT_STATE_TRANSFERRING, time.monotonic() + REFIT_TIMEOUT_S)
    t_kill = time.monotonic()
    for role in roles[1:]:
        peers.kill(role.name)
    hit = _outcome(ctl, 2, t_kill + REFIT_TIMEOUT_S)
    answered = _answers(peers, [roles[0]], 2, t_kill + REFIT_TIMEOUT_S)
    out |= {
        "faults_killed_agent_slots": slots_per_agent(workers),
        "faults_refit_hit": hit["state"] if hit else "not ended",
        "faults_refit_hit_reason": (hit or {}).get("reason", "")[:400],
        "faults_failed_after_kill_s": hit["ended_at_monotonic"] - t_kill if hit else None,
    }
    # the victims come back: the same ranks and slots
    t_back = time.monotonic()
    peers.start_all(roles[1:], timeout_s=REFIT_TIMEOUT_S)
    back = peers.registered([r.name for r in roles[1:]], timeout_s=REFIT_TIMEOUT_S)
    out["faults_reregistered_s"] = time.monotonic() - t_back
    # of it, the victims' RegisterWorker calls (the rest: process start, agents)
    out["faults_reregister_calls_s"] = max(r.seconds for r in back.values())
    after = _refit(ctl, peers, roles, 3)
    out["faults_refit_after"] = after["state"]
    out["faults_refit_after_s"] = after.get("seconds")
    # when (seconds from its start) the refit after entered each phase; its pause
    out["faults_refit_after_phase_at_s"] = after.get("phase_at_s")
    out["faults_recovery_s"] = after["ended_at_monotonic"] - t_back if after else None
    told = _told(peers, roles)  # the restarted victims' ranks know nothing of refit 2
    out |= {
        "faults_hangs": int(hit is None) + int(not answered) + int(after.get("hung", False)),
        "faults_torn": sum(("COMMIT", 2) in ev for ev in told.values()),
        "faults_untold": _untold(told, 2),
        "faults_lost": _lost(ctl, workers, 3),
        "faults_rss_before_mb": rss_before / 1e6,
        "faults_rss_after_recovery_mb": me.memory_info().rss / 1e6,
    }
    return out


def _count(role: PeerRole, workers: int) -> int:
    """Metadata workers of `role`."""
    return sum(1 for i in range(workers) if i % role.of in role.share)


def _ask(peers: Peers, roles: list[PeerRole], version: int) -> None:
    for role in roles:
        peers.send(role.name, ("refit", version, REFIT_TIMEOUT_S))


def _refit(ctl: Any, peers: Peers, roles: list[PeerRole], version: int) -> dict:
    """A refit of the metadata model asked by every trainer rank; its record (with
    "hung" when it did not end or a call was not answered in time)."""
    _ask(peers, roles, version)
    deadline = time.monotonic() + REFIT_TIMEOUT_S
    rec = _outcome(ctl, version, deadline)
    answered = _answers(peers, roles, version, deadline)
    if rec is None:
        return {"state": "not ended", "seconds": None, "hung": True}
    return rec | {"hung": not answered}


def _answers(peers: Peers, roles: list[PeerRole], version: int, deadline: float) -> bool:
    """Whether every role's Refit calls of `version` were answered by `deadline`."""
    try:
        for role in roles:
            peers.next(deadline, lambda m, n=role.name: m[:3] == ("refit", n, version))
    except TimeoutError:
        return False
    return True


def _await_state(ctl: Any, version: int, state: int, deadline: float) -> None:
    """Until the running refit of `version` of the metadata model reaches `state`."""
    while time.monotonic() < deadline:
        run = ctl.refits.running(META_MODEL)
        if run is not None and run.version == version and run.state >= state:
            return
        time.sleep(0.005)
    raise TimeoutError(f"refit {version} of the metadata model never reached state {state}")


def _outcome(ctl: Any, version: int, deadline: float) -> dict | None:
    """The final record of `version` of the metadata model (its end as a monotonic time
    added), or None at `deadline`."""
    while time.monotonic() < deadline:
        for r in reversed(ctl.refits.history):
            if r.model == META_MODEL and r.version == version and r.ended_at:
                lag = time.time() - r.ended_at
                return r.to_json() | {"ended_at_monotonic": time.monotonic() - lag}
        time.sleep(0.01)
    return None


def _told(peers: Peers, roles: list[PeerRole]) -> dict[tuple[str, int], list]:
    """What every live inference rank was told, over the roles."""
    told: dict[tuple[str, int], list] = {}
    deadline = time.monotonic() + 60
    for role in roles:
        peers.send(role.name, ("told",))
    for role in roles:
        _, _, got = peers.next(deadline, lambda m, n=role.name: m[:2] == ("told", n))
        told |= got
    return told


def _untold(told: dict, version: int) -> int:
    """Ranks paused by `version` and never told its end (ABORT or INCOMPLETE, or COMMIT
    had it committed)."""
    n = 0
    for events in told.values():
        if ("PAUSE", version) not in events:
            continue
        after = events[events.index(("PAUSE", version)) + 1 :]
        if not any(v == version and k != "PAUSE" for k, v in after):
            n += 1
    return n


def _lost(ctl: Any, workers: int, version: int) -> int:
    """Metadata workers missing at the end, plus one when the committed version is not
    `version`."""
    with ctl.registry.lock:
        live = sum(1 for w in ctl.registry.workers.values() if w.model == META_MODEL and w.live)
        committed = ctl.registry.model(META_MODEL).committed_version
    return (workers - live) + int(committed != version)
