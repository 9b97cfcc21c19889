"""Adapter refits without a pause, through a real `refitd serve`: a Megatron tp=2 trainer
holding only the rank-16 LoRA adapters (q/k/v/o, gate/up/down) of a small transformers
Llama, drawn by PEFT, refits two engine pools (tp 1 and tp 2) that hold vLLM-shaped
stacked adapter buffers and register them through `register_adapter`.

While 20 versions land, a reader thread per engine rank keeps reading the slot it serves
(a request holds the engine's lock while it reads; a flip takes that lock, so it returns
once no request reads the old slot): every read equals, bit for bit, the slot vLLM's own
`set_lora` builds from the PEFT adapter of the version it serves. No engine is paused.
A trainer rank killed while the other waits in its refit fails that refit; the old
adapter keeps serving (its slot read throughout), and the next version lands again."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")

import torch.multiprocessing as mp
from _hf_models import LLAMA, config
from _lora_models import lora_trainer_rank, peft_adapter, set_adapter, stacked_buffers
from _lora_models import vllm_lora_layers as vllm_layers

from clients.engine_layouts import EngineParallel, engine_placements
from clients.engine_layouts.lora import lora_buffer_shapes, lora_engine_layout, lora_slot_views
from clients.hf_names import LlamaDims
from refitd.client import InferenceClient
from refitd.demo.run import Daemon

RANK, MAX_RANK, MAX_LORAS, SLOTS, VERSIONS = 16, 32, 4, (1, 3), 20
MODEL = "lora-llama"


@dataclass
class AdapterEngine:
    """One engine rank serving an adapter from its stacked buffers."""

    buffers: dict[str, torch.Tensor]
    lock: threading.Lock = field(default_factory=threading.Lock)
    slot: int | None = None
    version: int = 0
    pauses: int = 0  # the engine's pause hook
    events: list[str] = field(default_factory=list)  # every event kind delivered

    def flip(self, version: int, slot: int) -> None:
        with self.lock:  # no request reads the old slot once this is held
            self.slot, self.version = slot, version

    def request(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self.lock:
            if self.slot is None:
                return None
            return self.version, {n: b[self.slot].clone() for n, b in self.buffers.items()}


def expected_slots(d: LlamaDims, tp: int, versions: range) -> list[dict[int, dict]]:
    """Per rank, per version: every buffer's adapter slot as vLLM's set_lora fills it."""
    cfg = config(LLAMA)
    adapters = {v: peft_adapter(cfg, RANK, v) for v in versions}
    out = []
    for r in range(tp):
        layers = vllm_layers(d, tp, r, 1, MAX_RANK)
        per = {}
        for v, adapter in adapters.items():
            set_adapter(layers, 0, adapter)
            per[v] = {n: b[0].clone() for n, b in stacked_buffers(layers).items()}
        out.append(per)
    return out


def served_within(c: InferenceClient, version: int, timeout_s: float) -> bool:
    """Wait until the rank serves `version` (its COMMIT delivered), timeout_s at most."""
    done = threading.Event()
    deadline = time.monotonic() + timeout_s
    while c.served_version != version and time.monotonic() < deadline:
        done.wait(0.01)
    return c.served_version == version


@pytest.fixture(scope="module")
def lora_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=4, extra_args=["--barrier-timeout-s", "8", "--log-level", "info"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adapter_versions_flip_without_pause(lora_daemon: Daemon) -> None:
    d = LlamaDims.from_hf_config(config(LLAMA))
    failed, last = VERSIONS + 1, VERSIONS + 2  # a refit that fails, then one that lands
    want = {tp: expected_slots(d, tp, range(1, last + 1)) for tp in (1, 2)}
    engines: list[tuple[int, int, AdapterEngine, InferenceClient]] = []
    stop, errors, reads = threading.Event(), [], [0]
    ctx = mp.get_context("spawn")
    commands, results = [ctx.Queue(), ctx.Queue()], ctx.Queue()

    def trainer(rank: int) -> mp.Process:
        args = (rank, lora_daemon.address, MODEL, config(LLAMA), RANK, commands[rank], results,
                range(1, last + 1))  # fmt: skip
        p = ctx.Process(target=lora_trainer_rank, args=args, daemon=True)
        p.start()
        return p

    def answers(n: int) -> list[tuple]:
        got = []
        for _ in range(n):
            try:
                got.append(results.get(timeout=240))
            except queue.Empty:
                pytest.fail(f"trainer ranks did not answer; got {got}")
            assert got[-1][1] != "error", got[-1][2]
        return got

    def reader(tp: int, r: int, eng: AdapterEngine) -> Callable[[], None]:
        def run() -> None:
            while not stop.is_set():
                got = eng.request()
                if got is not None:
                    v, slot = got
                    bad = [n for n, x in slot.items() if not torch.equal(x, want[tp][r][v][n])]
                    if bad:
                        errors.append(f"tp{tp} rank {r} served v{v} with {bad[:3]} torn")
                    reads[0] += 1
                stop.wait(0.002)

        return run

    procs = [trainer(0), trainer(1)]
    threads = []
    try:
        for tp in (1, 2):
            for r in range(tp):
                layout = lora_engine_layout(d, EngineParallel(tp, r), RANK)
                shapes = lora_buffer_shapes(layout, MAX_LORAS, MAX_RANK)
                eng = AdapterEngine(
                    {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
                )
                c = InferenceClient(
                    lora_daemon.address, MODEL, f"tp{tp}", r, tp, f"cpu:{2 + r}",
                    pause=lambda v, e=eng: setattr(e, "pauses", e.pauses + 1), flip=eng.flip,
                )  # fmt: skip
                c.register_adapter(
                    lambda s, b=eng.buffers, ly=layout: engine_placements(
                        lora_slot_views(b, ly, s), ly
                    ),
                    SLOTS,
                )
                c.on_update(lambda e, ev=eng: ev.events.append(e.kind))
                engines.append((tp, r, eng, c))
                threads.append(threading.Thread(target=reader(tp, r, eng), daemon=True))
        assert sorted(answers(2)) == [(0, "registered", 0), (1, "registered", 0)]
        for t in threads:
            t.start()
        for v in range(1, VERSIONS + 1):
            for q in commands:
                q.put(("refit", v))
            assert {a[2] for a in answers(2)} == {"committed"}, v
        # Kill trainer rank 1 while rank 0 is in refit(failed): the refit fails; the
        # adapter of version VERSIONS keeps serving from its slot.
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10)
        commands[0].put(("refit", failed))
        (got,) = answers(1)
        assert got[:2] == (0, failed) and got[2].startswith("failed"), got
        for tp, r, eng, c in engines:
            assert served_within(c, VERSIONS, 60), (tp, r, c.served_version)
            assert eng.version == VERSIONS, (tp, r)
        commands[1] = ctx.Queue()  # the killed process may hold the old queue's lock
        procs[1] = trainer(1)  # back: the next attempt lands
        assert answers(1) == [(1, "registered", 0)]
        for q in commands:
            q.put(("refit", last))
        assert {a[2] for a in answers(2)} == {"committed"}
        for tp, r, _, c in engines:  # the COMMIT of `last` reaches each rank
            assert served_within(c, last, 60), (tp, r, c.served_version)
        stop.set()
        for t in threads:
            t.join(10)
        assert not errors, errors[:5]
        assert reads[0] > VERSIONS
        for tp, r, eng, c in engines:
            # no PAUSE, and no ABORT of the failed refit: only the commits reach the rank
            assert eng.pauses == 0 and eng.events == ["hello"] + ["commit"] * (VERSIONS + 1)
            assert (eng.version, c.served_version) == (last, last)
            served = eng.slot
            spare = SLOTS[1] if served == SLOTS[0] else SLOTS[0]
            for n, buf in eng.buffers.items():
                assert torch.equal(buf[served], want[tp][r][last][n]), (tp, r, n)
                assert torch.equal(buf[spare], want[tp][r][VERSIONS][n]), (tp, r, n)
                untouched = [s for s in range(MAX_LORAS) if s not in SLOTS]
                assert int(buf[untouched].count_nonzero()) == 0, (tp, r, n)
    finally:
        stop.set()
        for q in commands:
            q.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for *_, c in engines:
            c.close()
