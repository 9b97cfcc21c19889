"""Paths of links: the policy's choice per (source slot, destination slot), forced paths
falling back with their reason, and the paths a plan records (digest, summary, explain)."""

from __future__ import annotations

import numpy as np
import pytest

from refitd.plan.errors import PlanError
from refitd.plan.explain import explain
from refitd.plan.links import FALLBACKS, PATHS, LinkPolicy, SlotSite
from refitd.plan.planner import PlanConfig, build_plan

from .test_layouts_plan import tp_side

SITES = [
    SlotSite(0, "a", "cpu", ("mapped",)),
    SlotSite(1, "a", "cpu", ("mapped",)),
    SlotSite(2, "b", "cpu", ("mapped", "rdma", "rdma-auto")),
    SlotSite(3, "a", "cuda", ("mapped", "rdma", "rdma-auto")),
    SlotSite(4, "a", "cpu", ()),
    SlotSite(5, "c", "cuda", ("mapped", "rdma", "rdma-auto")),
]


def _choose(mode: str, pairs: list[tuple[int, int]]) -> list[tuple[str, str]]:
    src, dst = (np.array(x, np.int64) for x in zip(*pairs, strict=True))
    path, why = LinkPolicy.of(mode, list(reversed(SITES))).choose(src, dst)
    return [(PATHS[p], FALLBACKS[w]) for p, w in zip(path.tolist(), why.tolist(), strict=True)]


def test_auto_takes_the_best_path_each_link_offers() -> None:
    pairs = [(0, 1), (0, 2), (3, 5), (2, 3), (0, 3), (0, 4), (0, 9)]
    assert [p for p, _ in _choose("auto", pairs)] == [
        "mapped",  # one host, one device kind, both offer it
        "collective",  # other hosts, slot 0 offers no rdma
        "rdma",  # other hosts, both offer rdma
        "rdma",
        "collective",  # one host but CPU and GPU: not mapped; no rdma at slot 0
        "collective",  # slot 4's agent offers nothing
        "collective",  # slot 9 is unknown
    ]
    assert all(why == "" for _, why in _choose("auto", pairs))


def test_a_forced_path_falls_back_to_collective_naming_why() -> None:
    got = _choose("mapped", [(0, 1), (0, 2), (0, 3), (0, 4), (0, 9)])
    assert got == [
        ("mapped", ""),
        ("collective", "the slots are on different hosts"),
        ("collective", "the slots hold different kinds of device"),
        ("collective", "an agent of the link does not offer it"),
        ("collective", "a slot of the link is unknown to the policy"),
    ]
    assert _choose("rdma", [(3, 5), (0, 1)]) == [
        ("rdma", ""),
        ("collective", "an agent of the link does not offer it"),
    ]
    assert _choose("collective", [(0, 1)]) == [("collective", "")]
    with pytest.raises(PlanError, match="unknown links policy 'fast'"):
        LinkPolicy.of("fast", SITES)


def _sides():
    src = tp_side("train", 2, 1, 1, (48, 8), 0, 0)  # slots 0, 1
    dst = tp_side("inf", 1, 2, 1, (48, 8), 0, 1)  # slots 1, 2
    return src, dst


def test_a_plan_records_every_message_path_in_its_digest_summary_and_explain() -> None:
    src, dst = _sides()
    sites = [SlotSite(0, "a", "cpu", ("mapped",)), SlotSite(1, "a", "cpu", ("mapped",)),
             SlotSite(2, "b", "cpu", ("mapped",))]  # fmt: skip
    plans = {
        mode: build_plan("m", 1, src, dst, PlanConfig(links=LinkPolicy.of(mode, sites)))
        for mode in ("collective", "auto", "mapped")
    }
    assert len({p.digest for p in plans.values()}) == 3  # the paths are part of the digest
    auto = plans["auto"].link_summary()
    assert auto["policy"] == "auto" and auto["local"]["copies"] > 0
    assert set(auto) == {"policy", "mapped", "collective", "local"}
    forced = plans["mapped"].link_summary()
    assert forced["fallback"]["messages"] == {
        "the slots are on different hosts": auto["collective"]["messages"]
    }
    assert "fallback" not in auto
    # explain: every feed of the slot-2 replica comes over a collective link (other host),
    # of the slot-1 one over a mapped link or as a local copy
    for shard in explain(plans["auto"], "w"):
        paths = {f.path for f in shard.feeds}
        assert paths == ({"collective"} if shard.slot == 2 else {"mapped", "local"}), paths
        for f in shard.feeds:
            assert f.path in f.line() and (f.message is None) == (f.path == "local")
            if f.message is not None:
                assert plans["auto"].message_path(f.message) == f.path


def test_auto_takes_rdma_only_where_both_agents_offer_rdma_auto() -> None:
    """Over TCP the collective path is usually faster than one-sided writes: `auto` picks
    rdma only between agents that both offer `rdma-auto` (an RDMA fabric, or asked for)."""
    sites = [SlotSite(0, "a", "cpu", ("mapped", "rdma")),
             SlotSite(1, "b", "cpu", ("mapped", "rdma", "rdma-auto")),
             SlotSite(2, "c", "cpu", ("mapped", "rdma", "rdma-auto"))]  # fmt: skip
    src, dst = np.array([0, 1, 2], np.int64), np.array([1, 2, 0], np.int64)
    auto, _ = LinkPolicy.of("auto", sites).choose(src, dst)
    assert [PATHS[p] for p in auto.tolist()] == ["collective", "rdma", "collective"]
    forced, why = LinkPolicy.of("rdma", sites).choose(src, dst)
    assert [PATHS[p] for p in forced.tolist()] == ["rdma"] * 3 and not why.any()
