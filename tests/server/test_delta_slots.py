"""Which slots the delta path serves: its payloads are host memory, so CPU slots always and
CUDA slots (staged through pinned host memory) where the transport carries host buffers."""

from __future__ import annotations

from pathlib import Path

from refitd.server.database import StateDB
from refitd.server.registry import Registry


def test_cuda_slots_join_the_delta_path_over_host_buffers(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    try:
        reg = Registry(db)
        agent = reg.register_agent("h", ["cpu:0", "cuda:0", "cuda:1"], pid=1)
        cpu, *cuda = agent.slot_ids
        assert reg.slots[cpu].device == "cpu:0"
        assert {reg.slots[s].device for s in cuda} == {"cuda:0", "cuda:1"}
        assert reg.delta_slots(device_slots=True) == frozenset(agent.slot_ids)
        assert reg.delta_slots(device_slots=False) == frozenset({cpu})
    finally:
        db.close()
