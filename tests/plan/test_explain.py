"""Plan explanation: which source ranks and boxes feed a destination shard."""

from __future__ import annotations

import numpy as np
import pytest

from refitd.plan.errors import PlanError
from refitd.plan.explain import explain, format_explanations
from refitd.plan.planner import PlanConfig, build_plan

from .test_layouts_plan import tp_side


def _plan(relay: bool = False):
    # Megatron TP=2 rows of an (8, 4) float32 tensor -> 3 replicas (TP=1) on slots 10..12
    src = tp_side("train", 2, 1, 1, (8, 4), 0, 0)
    dst = tp_side("infer", 1, 3, 1, (8, 4), 0, 10)
    return build_plan("m", 1, src, dst, PlanConfig(relay=relay, bucket_bytes=64))


def test_every_element_of_a_shard_is_fed_once_from_the_rank_that_holds_it() -> None:
    [shard] = explain(_plan(), "w", "infer", 1)
    assert (shard.pool, shard.rank, shard.slot, shard.local_shape) == ("infer", 1, 11, (8, 4))
    hit = np.zeros((8, 4), int)
    for f in shard.feeds:
        (r0, r1), (c0, c1) = f.dest_box
        hit[r0:r1, c0:c1] += 1
        rank = int(f.source.split(":")[1])
        (g0, g1), _ = f.source_box
        assert 4 * rank <= g0 < g1 <= 4 * rank + 4  # trainer rank r holds rows 4r..4r+4
        assert (g0, g1) == (r0, r1) and f.wire == "raw" and f.route == "direct"
        assert f.nbytes >= (r1 - r0) * (c1 - c0) * 4
    assert (hit == 1).all()
    text = format_explanations([shard])
    assert "infer:1 w (canonical w, local 8x4 float32, slot 11)" in text
    assert "S(train:0)[0:" in text and "-> R[0:" in text and "round " in text


def test_relayed_copies_name_the_forwarding_replica_and_the_original_source() -> None:
    plan = _plan(relay=True)
    feeds = [f for s in explain(plan, "w") for f in s.feeds]
    relays = [f for f in feeds if f.route == "relay"]
    assert relays, "three replicas of two source ranks: some blocks are forwarded"
    for f in relays:
        assert f.via.startswith("infer:") and f.source.startswith("train:")
        assert "via infer:" in f.line()
    assert len(explain(plan, "w")) == 3


def test_errors_name_the_unknown_tensor_pool_and_rank() -> None:
    plan = _plan()
    with pytest.raises(PlanError, match=r"model 'm' has no destination tensor 'ww'.*'w'"):
        explain(plan, "ww")
    with pytest.raises(PlanError, match=r"no shard in pool 'vllm' \(pools holding it: infer\)"):
        explain(plan, "w", "vllm")
    with pytest.raises(PlanError, match=r"no shard on rank 7 in pool 'infer' \(ranks .*0\.\.2"):
        explain(plan, "w", "infer", 7)
