"""Delta messages over real Gloo (ranks in threads of this process): five successive delta
refits land bit for bit, a destination that missed a version gets dense, a delta applied to
the wrong base is caught by the checksums of the reconstructed destination, and the sender's
base only advances on promote."""

from __future__ import annotations

from _delta_cluster import Cluster

from refitd.executor.delta.exchange import KIND_DELTA, KIND_DENSE, UNKNOWN


def test_five_successive_delta_refits_bit_for_bit() -> None:
    c = Cluster(lr=1e-5)
    try:
        c.refit(0, allowed={})  # version 0: everything dense
        c.check()
        for v in range(1, 6):
            for slot, b in c.bases.items():
                assert b.promote(v - 1, c.access[slot])  # v - 1 committed everywhere
            c.step(v)
            reps = c.refit(v)
            c.check()
            sent = [m for r in (0, 1) for m in reps[r].sent.values()]
            assert all(m["kind"] == KIND_DELTA for m in sent)
            density = sum(m["changed"] for m in sent) / sum(m["elements"] for m in sent)
            assert 0 < density < 0.4
            assert sum(m["nbytes"] for m in sent) < sum(m["dense_nbytes"] for m in sent)
    finally:
        c.close()


def test_missed_version_gets_dense_and_wrong_base_is_caught() -> None:
    c = Cluster(lr=1e-5)
    try:
        c.refit(0, allowed={})
        for slot, b in c.bases.items():
            assert b.promote(0, c.access[slot])
        # slot 3 restarts: its memory no longer holds version 0
        for i, d in enumerate(c.dst):
            if d.slot == 3:
                c.tensors[len(c.src) + i].fill_(0)
        to3 = {r: {m.mid for m in c.access[r].sends.values() if m.peer == 3} for r in (0, 1)}
        c.step(1)
        # a delta to slot 3 anyway (what the controller must never allow) lands wrong, and
        # the checksums of the reconstructed destination say so
        reps = c.refit(1, allowed=None, verify=True)
        bad = {m for r in (0, 1) for m in to3[r]}
        for mid in bad:
            send = next(reps[r].send_sums[mid] for r in (0, 1) if mid in reps[r].send_sums)
            assert reps[3].recv_sums[mid] != send
        for mid, s in reps[2].recv_sums.items():
            assert s == next(reps[r].send_sums[mid] for r in (0, 1) if mid in reps[r].send_sums)
        # the retry (same version): slot 3's messages dense, the others delta
        allowed = {r: {m for m in c.access[r].sends} - to3[r] for r in (0, 1)}
        reps = c.refit(1, allowed=allowed, verify=True)
        c.check()
        for r in (0, 1):
            for mid, m in reps[r].sent.items():
                assert m["kind"] == (KIND_DENSE if mid in to3[r] else KIND_DELTA)
                assert reps[r].send_sums[mid] == reps[2 + (mid in bad)].recv_sums[mid]
    finally:
        c.close()


def test_base_advances_only_on_promote() -> None:
    """A version that was sent but not promoted (a failed refit) leaves the base where it
    was; the next delta is against the old base and lands on destinations that hold it."""
    c = Cluster(lr=1e-6)
    try:
        c.refit(0, allowed={})
        for slot, b in c.bases.items():
            assert b.promote(0, c.access[slot]) and b.version == 0
        before = [t.clone() for t in c.tensors[len(c.src) :]]
        c.step(1)
        c.refit(1)  # version 1 is sent, then (say) fails to commit: destinations roll back
        for t, old in zip(c.tensors[len(c.src) :], before, strict=True):
            t.copy_(old)
        assert all(b.version == 0 for b in c.bases.values())
        c.step(2)
        reps = c.refit(2)  # deltas from version 0
        c.check()
        assert all(m["kind"] == KIND_DELTA for r in (0, 1) for m in reps[r].sent.values())
        for slot, b in c.bases.items():
            assert not b.promote(1, c.access[slot]) and b.version == UNKNOWN
    finally:
        c.close()


def test_clearly_dense_message_skips_the_full_encode(monkeypatch) -> None:
    """A message whose sampled density is well above the threshold goes dense without a
    full delta encode (no encode buffer is made for it), reports the estimated density,
    and lands bit for bit; at a low density the full encode still runs and sends deltas."""
    import refitd.executor.delta.exchange as dx

    monkeypatch.setattr(dx, "SAMPLE_MIN_BYTES", 0)  # every message of the small test model
    monkeypatch.setattr(dx, "SAMPLE_STRIDE", 1)
    c = Cluster(lr=1e-3)
    try:
        c.refit(0, allowed={})
        for slot, b in c.bases.items():
            assert b.promote(0, c.access[slot])
        c.step(1)
        reps = c.refit(1)
        c.check()
        sent = [(r, mid, m) for r in (0, 1) for mid, m in reps[r].sent.items()]
        assert sent and all(m["kind"] == KIND_DENSE for _, _, m in sent)
        assert all(m["changed"] / m["elements"] > 0.5 for _, _, m in sent)
        assert all(mid not in c.bases[r].sinks for r, mid, _ in sent)
    finally:
        c.close()
