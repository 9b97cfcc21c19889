"""Refits across emulated hosts: bit for bit, data-plane addressing, partitions, restarts.

Every inference rank checks every version it is told about bit for bit (and the version it
serves before each pause: a torn version shows as a mismatch); see the conftest topology.
"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from refitd.bench.cluster.multihost import MultiHostCluster
from refitd.cli.status import render
from refitd.demo.gpt import GptConfig
from refitd.transport.mooncake_env import mooncake_unavailable_reason

from .conftest import LEASE_S, MB

pytestmark = pytest.mark.slow


def _committed(c: MultiHostCluster, version: int) -> None:
    c.wait_for("agents connected, ranks live and subscribed", lambda: c.agents_connected()
               and c.ranks_ready(), time.monotonic() + 60)  # fmt: skip
    out = c.refit(version)
    assert out.state == "committed", out.messages
    assert set(out.commits.values()) == {"ok"}, out.commits
    assert c.mismatches == []


def test_tp2_trainer_to_two_pools_spread_over_two_hosts(cluster: MultiHostCluster) -> None:
    before = cluster.net.link_bytes()
    for v in (1, 2):
        _committed(cluster, v)
    after = cluster.net.link_bytes()
    doc = cluster.status()
    planes = {a["host"]: a["data_plane_address"] for a in doc["agents"] if a["connected"]}
    # hostb's name maps to 127.0.1.1, hostc's resolves to nothing: their own addresses anyway.
    assert planes == {h: cluster.net.hosts[h].address for h in ("hosta", "hostb", "hostc")}
    # The bytes crossed the links: each inference host holds one model's worth of shards
    # (half of each pool), none of which has a source on that host.
    model = GptConfig.for_megabytes(MB, layers=2).nbytes
    for host in ("hostb", "hostc"):
        received = after[host][1] - before[host][1]
        assert received >= 2 * model, (host, received, model)
    sent = after["hosta"][0] - before["hosta"][0]
    assert sent >= 2 * model  # two versions, each read once from the trainer host


def test_one_refit_mixes_local_mapped_rdma_and_collective_links(
    cluster: MultiHostCluster,
) -> None:
    """infer-c shares hosta with the trainer: a local copy from the rank on its slot and a
    mapped link from the other slot; the pool ranks on hostb are reached by rdma writes
    (where Mooncake imports), those on hostc (no rdma offered) by the communicator. The
    plan, the status and the refit record say so."""
    doc = cluster.status()
    model = next(m for m in doc["models"] if m["name"] == cluster.model)
    _committed(cluster, model["committed_version"] + 1)
    doc = cluster.status()
    links = next(m for m in doc["models"] if m["name"] == cluster.model)["plan"]["links"]
    assert links["policy"] == "auto" and "fallback" not in links, links
    assert links["mapped"]["messages"] > 0 and links["collective"]["messages"] > 0, links
    assert links["local"]["copies"] > 0, links
    rdma = mooncake_unavailable_reason() is None
    assert ("rdma" in links) == rdma, links
    record = doc["refits"][0]
    assert record["state"] == "committed" and record["links"] == links, record
    offers = ["mapped", "rdma", "rdma-auto"] if rdma else ["mapped"]
    assert {a["host"]: a["links"] for a in doc["agents"] if a["connected"]} == {
        "hosta": offers,
        "hostb": offers,
        "hostc": ["mapped"],
    }
    line = next(x for x in render(doc).splitlines() if "links auto:" in x)
    assert "mapped" in line and "collective" in line and "local" in line, line
    assert ("rdma" in line) == rdma, line


def test_agent_with_loopback_data_plane_refuses_to_start(cluster: MultiHostCluster) -> None:
    argv = cluster.agent_argv("hostc", ["--data-plane-address", "127.0.0.1"])
    argv[argv.index("--devices") + 1] = "cpu:7"
    proc = subprocess.run(
        cluster.net.command("hostc", argv), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refusing to start" in proc.stderr
    assert "127.0.0.1 (from --data-plane-address) is a loopback address" in proc.stderr
    assert cluster.address in proc.stderr and "--data-plane-interface" in proc.stderr


def _partitioned_refit(c: MultiHostCluster, host: str, version: int, down_s: float) -> None:
    """Take `host`'s link down, refit `version` meanwhile, heal after `down_s`: the version
    ends committed or failed with a reason, never torn; the next version commits."""
    healed = threading.Event()
    c.net.set_link(host, up=False)
    try:
        c.step(version, timeout_s=60)
        deadline = time.monotonic() + down_s
        # The refit is under way (the controller, on its own host, says so) while down.
        c.wait_for(f"v{version} running", lambda: _running(c) == version, deadline + 5)
        healed.wait(max(0.0, deadline - time.monotonic()))  # the partition's length is the point
    finally:
        c.net.set_link(host, up=True)
    out = c.outcome(version, 60)
    print(f"{host} down {down_s:g}s: v{version} {out.state} in {out.seconds:.2f}s {out.messages}")
    assert out.state in ("committed", "failed"), out.states
    if out.state == "failed":
        assert all(m.strip() for m in out.messages.values()), out.messages
        assert len(set(out.messages.values())) == 1, out.messages  # one outcome per version
    else:
        assert set(out.commits.values()) == {"ok"}, out.commits
    assert c.mismatches == []
    c.wait_for("cluster back", lambda: c.agents_connected() and c.ranks_ready(),
               time.monotonic() + 60)  # fmt: skip
    _committed(c, version + 1)


def _running(c: MultiHostCluster) -> int:
    m = next((m for m in c.status().get("models", []) if m["name"] == c.model), None)
    run = (m or {}).get("running")
    return run["version"] if run else 0


def test_partition_of_5s_during_a_refit(cluster: MultiHostCluster) -> None:
    _partitioned_refit(cluster, "hostc", 10, 5.0)


def test_partition_longer_than_the_lease(cluster: MultiHostCluster) -> None:
    _partitioned_refit(cluster, "hostb", 20, LEASE_S + 2.0)


def test_agent_host_restart(cluster: MultiHostCluster) -> None:
    _committed(cluster, 30)
    assert cluster.net.kill_host("hostc") >= 3  # agent, its transfer processes, workers
    cluster.restart("agent-hostc", "hostc", cluster.agent_argv("hostc"), None)
    cluster.restart("workers-hostc", "hostc", cluster.worker_argv("hostc"), "ready")
    cluster.wait_for("hostc back", lambda: cluster.agents_connected() and cluster.ranks_ready(),
                     time.monotonic() + 60)  # fmt: skip
    _committed(cluster, 31)
