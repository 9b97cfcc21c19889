"""Verification of a transfer: the senders' and receivers' checksums of every message of a
plan compared (integers only: the controller never touches tensor bytes)."""

from __future__ import annotations

from refitd.server.planning import ControllerPlan


def compare_checksums(
    plan: ControllerPlan, sent: dict[int, tuple[int, int]], landed: dict[int, tuple[int, int]]
) -> str | None:
    """None when every message's sender and receiver checksums (id -> (slot, checksum))
    agree; else why not, naming the messages, slots and destination tensors (pool, rank,
    name) involved (the first 4 messages)."""
    ids = sent.keys() | landed.keys()
    bad = sorted(i for i in ids if i not in sent or i not in landed or sent[i][1] != landed[i][1])
    if not bad:
        if len(ids) != plan.stats.messages:  # e.g. an agent that does not verify
            return (
                f"checksums of {plan.stats.messages - len(ids)} of {plan.stats.messages} "
                "messages were not reported"
            )
        return None
    lines = [_mismatch(plan, mid, sent, landed) for mid in bad[:4]]
    extra = f" (and {len(bad) - 4} more messages)" if len(bad) > 4 else ""
    return f"checksum mismatch in {len(bad)} messages{extra}: " + "; ".join(lines)


def _mismatch(
    plan: ControllerPlan,
    mid: int,
    sent: dict[int, tuple[int, int]],
    landed: dict[int, tuple[int, int]],
) -> str:
    """One message's disagreement, naming its slots and destination tensors."""
    if mid not in sent or mid not in landed:
        side = "sender" if mid not in sent else "receiver"
        slot = (landed.get(mid) or sent[mid])[0]
        return f"message {mid}: no {side} checksum (other end: slot {slot})"
    (src_slot, a), (dst_slot, b) = sent[mid], landed[mid]
    program = plan.program(dst_slot)
    tensors = sorted(
        {
            (s.pool, s.rank, s.name)
            for m in program.recvs
            if m.id == mid
            for s in (plan.tensors[c.dst_tensor] for c in m.copies)
        }
    )
    names = ", ".join(f"({p!r}, {r}, {n!r})" for p, r, n in tensors[:8])
    more = f" and {len(tensors) - 8} more" if len(tensors) > 8 else ""
    return (
        f"message {mid} from slot {src_slot} to slot {dst_slot}: sent {a:#018x} != "
        f"landed {b:#018x}; destination tensors (pool, rank, name): {names}{more}"
    )
