"""refitd as a vLLM weight-transfer backend, against vLLM 0.33's own classes: the entry
point registers `refitd` with vLLM's factory (twice), the factory builds the engine, the
start -> update -> finish sequence lands a Megatron trainer's versions bit for bit in the
parameters of engine ranks (TP 0 and 1 of 2) while requests keep flowing (every answer
equals the logits of the one version it is stamped with), out-of-order calls raise as
vLLM's do, an uncovered parameter fails init, and the trainer side feeds the engines from
vLLM's ModuleSource of an FSDP2 (DTensor) module."""

from __future__ import annotations

import queue
import threading
import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _backend_workers import (
    fsdp_vllm_rank,
    megatron_rank,
    on_all,
    require_vllm,
    vllm_engines,
)
from _engine_models import EngineModel, loaded_buffers
from _hf_models import LLAMA, config, model

from clients.engine_example import TinyEngine
from clients.engine_layouts import EngineParallel, engine_layout_for
from refitd.demo.run import Daemon, free_port

require_vllm()

from vllm.plugins import load_plugins_by_group  # noqa: E402

from clients.vllm_backend.engine import RefitdWeightTransferEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BATCH = torch.tensor([[3, 17, 99, 4, 249, 8, 61, 7], [1, 2, 3, 4, 5, 6, 7, 8]])
SEEDS = {1: 31, 2: 32}


def engine_ranks(tp: int = 2) -> EngineModel:
    """Llama held as vLLM TP ranks (fused qkv_proj, gate_up_proj, vocabulary split)."""
    cfg = config(LLAMA)
    lays = [engine_layout_for(cfg, EngineParallel(tp, r), "vllm") for r in range(tp)]
    shapes = [{t.name: t.local_shape for t in lay.tensors} for lay in lays]
    return EngineModel(model(LLAMA, 0), tp, 1, "vllm", lambda r: shapes[r])


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit (NaN where the other has NaN: the engine's initial fill overflows)."""
    try:
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return False
    return True


def plugin() -> object:
    """refitd's `vllm.general_plugins` function, as vLLM's loader finds it (from the
    installed metadata; a checkout installed before the entry point existed: pyproject's)."""
    if any(ep.name == "refitd" for ep in entry_points(group="vllm.general_plugins")):
        return load_plugins_by_group("vllm.general_plugins")["refitd"]
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = table["project"]["entry-points"]["vllm.general_plugins"]["refitd"]
    return EntryPoint("refitd", value, "vllm.general_plugins").load()


def test_entry_point_registers_refitd_and_the_factory_builds_it() -> None:
    register = plugin()
    register()
    register()  # vLLM may load plugins again: not an error
    eng = engine_ranks()
    engines = vllm_engines(config(LLAMA), eng.ranks)
    assert all(type(e) is RefitdWeightTransferEngine for e in engines)
    e = engines[0]
    with pytest.raises(RuntimeError, match=r"not initialized\. Call init_transfer_engine"):
        e.start_weight_update()
    with pytest.raises(RuntimeError, match=r"not initialized\. Call init_transfer_engine"):
        e.update_weights({"version": 1})
    with pytest.raises(ValueError, match="Invalid update_info"):
        e.parse_update_info({"versions": 1})


def test_a_parameter_no_layout_covers_fails_init_with_its_name() -> None:
    """An extra parameter (a quantization scale the layout does not describe) fails
    init_transfer_engine naming it and the model family; nothing is registered (the
    controller address is never contacted)."""
    eng = engine_ranks()
    eng.ranks[0]["model.layers.1.self_attn.attn.k_scale"] = torch.ones(1)
    (engine, _) = vllm_engines(config(LLAMA), eng.ranks)
    info = engine.parse_init_info({"controller": "127.0.0.1:9", "model": "m"})
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.self_attn\.attn\.k_scale' of model family 'llama'"
    ):
        engine.init_transfer_engine(info)


@pytest.mark.slow
def test_start_update_finish_lands_megatron_versions_while_requests_flow(daemon: Daemon) -> None:
    """Two engine ranks (vLLM layout, TP 2) driven by a serving loop, as vLLM's workers are:
    the loop answers requests and, between two of them, runs start / update / finish on
    both ranks (update beside the Megatron tp=2 trainer's refit of v). Each version lands
    bit for bit; every answer equals the reference logits of the version it is stamped
    with; out-of-order calls raise."""
    name = "vllm-backend"
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in range(2)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=megatron_rank, daemon=True,
                    args=(r, daemon.address, name, LLAMA, SEEDS, commands[r], results))
        for r in range(2)
    ]  # fmt: skip
    for p in procs:
        p.start()
    eng = engine_ranks()
    engines = vllm_engines(config(LLAMA), eng.ranks)
    with torch.no_grad():
        want = {None: eng.logits(BATCH)} | {
            v: model(LLAMA, s)(BATCH).logits for v, s in SEEDS.items()
        }
    serving = TinyEngine({}, forward=eng.logits, served=lambda: engines[0].served_version)
    answers = []
    stop = threading.Event()

    def requests() -> None:
        while not stop.is_set():
            answers.append(serving.submit(BATCH).result(timeout=120))

    load = threading.Thread(target=requests, daemon=True)
    try:
        for e in engines:
            e.init_transfer_engine(e.parse_init_info(
                {"controller": daemon.address, "model": name, "pool": "infer",
                 "source_naming": "megatron", "device": "cpu:2"}))  # fmt: skip
        assert [results.get(timeout=120)[1] for _ in range(2)] == ["registered"] * 2
        serving.start()
        load.start()
        for v in SEEDS:
            serving.call(lambda: on_all([e.start_weight_update for e in engines])).result(60)
            for c in commands:
                c.put(("refit", v))
            update = serving.call(lambda v=v: on_all([lambda e=e: e.update_weights({"version": v}) for e in engines]))  # fmt: skip
            got = sorted(results.get(timeout=180) for _ in range(2))
            assert got == [(0, v, "committed"), (1, v, "committed")], got
            update.result(timeout=60)

            finish = [lambda e=e, v=v: e.finish_weight_update(str(v)) for e in engines]
            serving.call(lambda f=finish: on_all(f)).result(60)
            assert [e.served_version for e in engines] == [v, v]
            hf = model(LLAMA, SEEDS[v]).state_dict()
            bad = [(r, n) for r in (0, 1) for n, t in loaded_buffers(eng, r, hf).items()
                   if not torch.equal(eng.ranks[r][n], t)]  # fmt: skip
            assert bad == [], v
        for _ in range(600):  # one answer computed under the last version
            if answers and answers[-1].version == 2:
                break
            threading.Event().wait(0.1)
        e = engines[0]
        with pytest.raises(
            RuntimeError, match=r"^start_weight_update must be called before update_weights"
        ):
            e.update_weights({"version": 3})
        with pytest.raises(
            RuntimeError,
            match=r"^finish_weight_update called without a matching start_weight_update",
        ):
            e.finish_weight_update()
        e.start_weight_update()
        with pytest.raises(
            RuntimeError,
            match=r"^start_weight_update called while a weight update is already active",
        ):
            e.start_weight_update()
        with pytest.raises(ValueError, match=r"names weight version '7'.*serves refitd version 2"):
            e.finish_weight_update("7")
    finally:
        stop.set()
        load.join(120)
        serving.stop()
        for c in commands:
            c.put(("stop",))
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for e in engines:
            e.shutdown()
    assert {a.version for a in answers} >= {1, 2}
    assert [a.version for a in answers if not same(a.output, want[a.version])] == []


@pytest.mark.slow
def test_trainer_side_sends_a_dtensor_module_source(daemon: Daemon) -> None:
    """vLLM's trainer API with the `refitd` init info: two FSDP2 ranks hand vLLM's
    ModuleSource of their DTensor module to WeightTransferTrainerFactory.trainer_init and
    call send_weights (v1, then v2 after new values in their shards); the vLLM engine ranks
    (TP 2, in the sender's process) hold each version bit for bit, serve it, and vLLM's
    finish got weight_version = the refitd version."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (free_port(), daemon.address, "vllm-trainer", LLAMA, (41, 42), results)
    procs = [ctx.Process(target=fsdp_vllm_rank, args=(r, *args), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < 4:
            try:
                rank, v, report = results.get(timeout=300)
            except queue.Empty:
                pytest.fail(f"trainer ranks did not report; got {got}")
            assert v != "error", report
            got[(rank, v)] = report
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for v in (1, 2):
        assert got[(1, v)] == (v, "committed")
        assert got[(0, v)] == (v, "committed", [], [v, v], str(v))


@pytest.mark.slow
def test_neither_side_waits_for_the_other_without_a_bound(daemon: Daemon) -> None:
    """A refit the engine is not receiving is refused at PAUSE within pause_wait_s (the
    weights stay untouched); an update no refit comes for times out; the next
    start -> update -> finish beside its refit lands."""
    from refitd.client import RefitError, TrainerClient

    eng = engine_ranks(tp=1)
    (engine,) = vllm_engines(config(LLAMA), eng.ranks)
    before = {n: t.clone() for n, t in eng.ranks[0].items()}
    ref = model(LLAMA, 71)
    trainer = TrainerClient(daemon.address, "vllm-bounds", rank=0, device="cpu:0")
    try:
        trainer.register(dict(ref.state_dict()))
        info = {"controller": daemon.address, "model": "vllm-bounds", "device": "cpu:3",
                "pause_wait_s": 1.0}  # fmt: skip
        engine.init_transfer_engine(engine.parse_init_info(info))
        with pytest.raises(RefitError, match=r"PAUSE for version 1 refused"):
            trainer.refit(1, wait="committed", timeout=60)
        assert all(torch.equal(eng.ranks[0][n], t) for n, t in before.items())
        engine.start_weight_update()
        with pytest.raises(TimeoutError, match=r"version 2 did not land within 1 s"):
            engine.update_weights({"version": 2, "timeout_s": 1.0})
        engine.start_weight_update()  # the failed update ended its session
        done = on_all([
            lambda: engine.update_weights({"version": 3}),
            lambda: trainer.refit(3, wait="committed", timeout=60),
        ])  # fmt: skip
        engine.finish_weight_update("3")
        assert done[1].state == "committed" and engine.served_version == 3
        want = loaded_buffers(eng, 0, ref.state_dict())
        assert [n for n, t in want.items() if not torch.equal(eng.ranks[0][n], t)] == []
    finally:
        trainer.close()
        engine.shutdown()
