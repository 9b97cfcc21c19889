"""The memory handles each slot's LoadProgramCommand carries, serialized once per holders.

A slot's load names, for every tensor its program reads or writes on its device, the
memory handle its worker registered. At 1,024 ranks that is ~786k handles, seconds of
Python to build; a program sent again with the same plan and the same workers holding
the slot's tensors (a restarted agent's slots) reuses the bytes of its last load, and the
ones built are appended in place into one message per slot.
"""

from __future__ import annotations

from refitd._proto import refitd_pb2 as pb
from refitd.server.planning import SlotInputs
from refitd.server.refit.membership import Membership
from refitd.server.registry import Registry


class LoadHandles:
    """Per (model, slot): the plan digest, the inputs (planning.slot_inputs) and the
    serialized handles of its last load."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._kept: dict[tuple[str, int], tuple[str, SlotInputs, bytes]] = {}
        self.built = 0  # slots whose handles were built (not reused)

    def of(self, ms: Membership, todo: dict[int, SlotInputs]) -> dict[int, bytes]:
        """Per slot of `todo`, its load's memory handles as a serialized LoadProgramCommand
        holding only them (merged into the command): kept when the plan and the workers
        it holds are those of its last load, else built."""
        plan, out = ms.plan, {}
        for slot, inputs in todo.items():
            kept = self._kept.get((ms.model, slot))
            if kept is not None and kept[0] == plan.digest and kept[1] == inputs:
                out[slot] = kept[2]
        build = [slot for slot in todo if slot not in out]
        if not build:
            return out
        memory = self.registry.memory_index(
            ms.model, {k for slot in build for k, _ in todo[slot][0]}
        )
        none: dict[str, bytes] = {}
        flagged = ms.staged_pools | ms.snapshot_pools
        for slot in build:
            msg = pb.LoadProgramCommand()
            add = msg.handles.add  # in place: a third of building each message first
            for i, t in plan.held(plan.load_payload(slot)):
                mem = memory.get((t.pool, t.rank), none).get(t.name, b"")
                if t.pool in flagged:
                    staged, snap = t.pool in ms.staged_pools, t.pool in ms.snapshot_pools
                    add(index=i, memory=mem, staged=staged, snapshot=snap)
                else:
                    add(index=i, memory=mem)
            out[slot] = msg.SerializeToString()
            self._kept[(ms.model, slot)] = (plan.digest, todo[slot], out[slot])
        self.built += len(build)
        return out
