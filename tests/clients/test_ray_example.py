"""Ray actors (2 trainer ranks, 1 inference rank) refit through the daemon, bit for bit."""

from __future__ import annotations

import pytest

from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow


def test_ray_actors_refit_through_the_daemon(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    # The shared CI machine runs other tests at once: Ray's memory monitor must not kill
    # our small actors because of someone else's usage.
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    from clients.ray_example import run

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = run(daemon.address, "ray-example", refits=2, seed=3)
    finally:
        ray.shutdown()
    assert rows == [
        {"version": v, "states": ["committed", "committed"], "mismatches": []} for v in (1, 2)
    ]
