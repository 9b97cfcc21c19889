"""A refitd cluster over four emulated hosts (network namespaces on a private bridge).

ctl: the controller (no agent). hosta: an agent and the trainer, tp=2 (2 ranks), and infer-c
(tp=1) on the trainer's first slot: its refit mixes a local copy (from trainer rank 0) and
a mapped link (from rank 1, the other slot of the host). hostb and hostc: an agent each and
one rank of each of two inference pools, tp=2 each (infer-a rank 0 and infer-b rank 1 on
hostb, the others on hostc), so every pool spans two hosts (collective links). hostb's
/etc/hosts maps its name to 127.0.1.1 (the Debian default) and hostc's name does not
resolve at all: the agents must not take their data-plane address from the host name.
hosta sets --data-plane-address, hostb --data-plane-interface, hostc uses the default (the
route to the controller). Where Mooncake imports, hosta and hostb offer the rdma path
(over TCP, `rdma_auto` on) and hostc, set to rdma_protocol=rdma without an RDMA device, does not: links
between hosta and hostb go rdma, those to hostc collective. Skipped only where network namespaces cannot be made (not root,
no `ip`). Torn down even on failure; namespaces of killed runs are removed first.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refitd.bench.cluster import netns
from refitd.bench.cluster.host_workers import RankSpec
from refitd.bench.cluster.multihost import AgentSpec, MultiHostCluster

LEASE_S = 8.0  # > the 5 s partition, with room for a busy 2-core machine
SERVE_ARGS = [
    "--heartbeat-interval-s", "0.5",
    "--heartbeat-timeout-s", str(LEASE_S),
    "--barrier-timeout-s", "20",
    "--pause-timeout-s", "10",
    "--connect-timeout-s", "10",
    "--load-timeout-s", "10",
    "--transfer-timeout-s", "10",
    "--commit-timeout-s", "10",
    "--refit-retries", "1",
    "--refit-retry-budget-s", "5",
    "--log-level", "warning",
]  # fmt: skip
HOSTS = ["ctl", "hosta", "hostb", "hostc"]
RESOLVES = {"hostb": "127.0.1.1", "hostc": None}
WORKERS = {
    "hosta": [
        RankSpec("trainer", 0, 2, "cpu:0"),
        RankSpec("trainer", 1, 2, "cpu:1"),
        RankSpec("infer-c", 0, 1, "cpu:0"),
    ],
    "hostb": [RankSpec("infer-a", 0, 2, "cpu:0"), RankSpec("infer-b", 1, 2, "cpu:1")],
    "hostc": [RankSpec("infer-a", 1, 2, "cpu:0"), RankSpec("infer-b", 0, 2, "cpu:1")],
}
MB = 0.25  # the smallest demo model (about 1.3 MB of BF16)

reason = netns.unavailable()


@pytest.fixture(scope="package")
def network() -> Iterator[netns.Network]:
    if reason is not None:
        pytest.skip(reason)
    net = netns.Network(HOSTS, RESOLVES)
    with net:
        yield net


@pytest.fixture(scope="package")
def cluster(network: netns.Network) -> Iterator[MultiHostCluster]:
    agents = {
        "hosta": AgentSpec(
            "cpu:0,cpu:1", ["--data-plane-address", network.hosts["hosta"].address, "--rdma-auto"]
        ),
        "hostb": AgentSpec("cpu:0,cpu:1", ["--data-plane-interface", "eth0", "--rdma-auto"]),
        # RDMA WRITEs asked for on a host without an RDMA device: hostc offers no rdma path
        "hostc": AgentSpec("cpu:0,cpu:1", ["--rdma-protocol", "rdma"]),
    }
    c = MultiHostCluster(network, "ctl", agents, WORKERS, MB, SERVE_ARGS)
    try:
        c.start(timeout_s=120)
        yield c
    finally:
        c.close()
