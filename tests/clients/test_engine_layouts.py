"""vLLM / SGLang engine layouts: a tiny engine (tests/clients/_engine_models.py) holds each
model as TP ranks of an inference engine do (fused qkv_proj with replicated KV heads,
gate_up_proj, FusedMoE w13/w2 under EP, padded vocabulary, MLA fused_qkv_a_proj) and runs
it from those tensors. A Megatron tp=2 x pp=2 trainer refits engine pools of tp 1, 2 and 4
(4 is above the 2 KV heads) through the daemon; the engine's logits then equal the
transformers reference's, bit for bit. An FSDP2 trainer of the transformers models (HF
names, `source_naming="hf"`) refits such pools too: every engine tensor equals what the
engines' loaders make of its weights, and the logits equal the trainer's."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
import torch

pytest.importorskip("transformers")

import torch.multiprocessing as mp
from _engine_models import PAD_FILL, EngineModel, fill_from, loaded_buffers, mxfp8_reference
from _hf_models import (
    DSV3,
    LLAMA,
    QWEN3,
    QWEN3_MOE,
    config,
    fsdp_trainer_rank,
    megatron_weights,
    model,
    trainer_rank,
)

from clients.engine_example import RefitdWorker, RefitdWorkerExtension
from clients.engine_layouts import (
    EngineLayout,
    EngineParallel,
    engine_layout_for,
    engine_placements,
    llama_engine_layout,
)
from clients.hf_names import LlamaDims, hf_checkpoint_tensors
from refitd.demo.run import Daemon, free_port
from refitd.plan.errors import PlanError

BATCH = torch.tensor([[3, 17, 99, 4, 249, 8, 61, 7], [1, 2, 3, 4, 5, 6, 7, 8]])
ENGINE = {LLAMA: "vllm", QWEN3: "sglang", QWEN3_MOE: "vllm", DSV3: "sglang"}
TPS = (1, 2, 4)


def ep_of(kind: str, tp: int) -> int:
    """Qwen3-MoE runs expert parallel (EP = TP); DeepSeek-V3 splits each expert over TP."""
    return tp if kind == QWEN3_MOE else 1


def layouts(kind: str, tp: int, naming: str = "megatron") -> list[EngineLayout]:
    cfg = config(kind)
    return [
        engine_layout_for(
            cfg, EngineParallel(tp, r, ep_of(kind, tp)), ENGINE[kind], source_naming=naming
        )
        for r in range(tp)
    ]


def shapes_of(lays: list[EngineLayout]) -> Callable[[int], dict[str, tuple[int, ...]]]:
    """What each engine rank allocates (stacked experts: local experts x slice shape)."""

    def shapes(r: int) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for t in lays[r].tensors:
            if t.index is None:
                out[t.name] = t.local_shape
            else:
                out[t.name] = (t.index + 1, *t.local_shape)
        return out

    return shapes


def engine(
    kind: str, tp: int, seed: int, naming: str = "megatron"
) -> tuple[EngineModel, list[EngineLayout]]:
    lays = layouts(kind, tp, naming)
    eng = EngineModel(model(kind, seed), tp, ep_of(kind, tp), ENGINE[kind], shapes_of(lays))
    return eng, lays


@pytest.mark.parametrize(("tp", "through_map"), [(1, 0), (2, 0), (4, 0), (2, 1), (4, 1)])
@pytest.mark.parametrize("kind", [LLAMA, QWEN3, QWEN3_MOE, DSV3])
def test_engine_boxes_hold_what_the_engine_forward_reads(
    kind: str, tp: int, through_map: int
) -> None:
    """Filling each engine registration from its boxes in the HF tensors, or through the
    name map in the Megatron tensors (rows past the vocabulary are padding and stay
    untouched), gives the reference logits exactly."""
    ref = model(kind, 0)
    hf = megatron_weights(kind, ref) if through_map else hf_checkpoint_tensors(ref)
    eng, lays = engine(kind, tp, 1)
    for r in range(tp):
        placed = engine_placements(eng.ranks[r], lays[r], through_map=bool(through_map))
        for p in placed.values():
            src = hf[p.canonical]
            for b in p.boxes:
                n0 = min(b.shape[0], src.shape[0] - b.offset[0])  # padding: past the vocab
                if n0 <= 0:
                    continue
                shape = (n0, *b.shape[1:])
                glob = tuple(slice(o, o + n) for o, n in zip(b.offset, shape, strict=True))
                loc = tuple(slice(o, o + n) for o, n in zip(b.local_offset, shape, strict=True))
                p.tensor[loc] = src[glob]
    with torch.no_grad():
        assert torch.equal(eng.logits(BATCH), ref(BATCH).logits)


def test_kv_replication_and_padding_shapes() -> None:
    """tp=4 over 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 head 1; the vocabulary
    of 250 is padded to 256, 64 rows per rank."""
    lays = layouts(QWEN3, 4)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for r, lay in enumerate(lays):
        t = lay.by_key()[qkv]
        assert t.local_shape == (16 + 16 + 16, 64)
        k = next(p for p in t.pieces if p.canonical.endswith("k_proj.weight"))
        assert (k.start, k.length, k.local) == (16 * (r // 2), 16, 16)
        assert lay.by_key()["model.embed_tokens.weight"].local_shape == (64, 64)
    assert "lm_head.weight" not in lays[0].by_key()  # tied: the engine's lm_head is the embedding
    rule = lays[0].name_map.index()["model.embed_tokens.weight"]
    assert (rule.parts[0].length, rule.padding) == (250, 6)


def test_bad_engine_layouts_name_the_tensor() -> None:
    cfg = config(LLAMA)
    with pytest.raises(PlanError, match=r"embed_tokens.*\(256, 64\) does not split over 3"):
        engine_layout_for(cfg, EngineParallel(3, 0), "vllm")
    dims = dataclasses.replace(LlamaDims.from_hf_config(cfg), heads=6, kv_heads=3)
    with pytest.raises(PlanError, match=r"layers\.0\.self_attn: 3 KV heads and TP 2"):
        llama_engine_layout(dims, EngineParallel(2, 0))
    with pytest.raises(ValueError, match="engine 'trt'"):
        engine_layout_for(cfg, EngineParallel(1, 0), "trt")
    with pytest.raises(ValueError, match=r"source_naming 'fsdp'.*'megatron', 'hf'"):
        engine_layout_for(cfg, EngineParallel(1, 0), "vllm", source_naming="fsdp")
    lay = engine_layout_for(cfg, EngineParallel(2, 0), "vllm")
    params = {t.name: torch.zeros(t.local_shape) for t in lay.tensors}
    params["model.layers.1.mlp.gate_up_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(PlanError, match=r"layers\.1\.mlp\.gate_up_proj.*\(64, 64\).*\(128, 64\)"):
        engine_placements(params, lay)
    del params["model.norm.weight"]
    with pytest.raises(PlanError, match=r"model\.norm\.weight.*missing"):
        engine_placements(params, lay)


class VllmWorker(RefitdWorkerExtension):
    """What vLLM builds with worker_extension_cls: a worker whose model runner holds the
    engine's module (rank 0 of a tp=1 pool); the engine model reads the module's own
    parameters, which the registration moves in place."""

    def __init__(self, eng: EngineModel, cfg: object) -> None:
        module = torch.nn.Module()
        for name, t in eng.ranks[0].items():
            *path, leaf = name.split(".")
            mod = module
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
        eng.ranks[0] = dict(module.named_parameters())
        runner_config = SimpleNamespace(hf_config=cfg)
        self.model_runner = SimpleNamespace(model=module, model_config=runner_config)
        self.rank = 0
        self.device = torch.device("cpu")


MXFP8_ENGINE = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
MXFP8_HF = tuple(f"{n}_proj.weight" for n in ("q", "k", "v", "o", "gate", "up", "down"))


@pytest.fixture(scope="module")
def qdaemon() -> Iterator[Daemon]:
    """A daemon that quantizes on the sender: MXFP8 destinations get an MXFP8 wire."""
    d = Daemon(cpu_slots=4, extra_args=["--sender-quantization", "--pause-timeout-s", "20"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.mark.slow
def test_megatron_trainer_refits_engine_pools_to_identical_logits(qdaemon: Daemon) -> None:
    """One refit of v1 lands in pools tp1, tp2 and tp4 (BF16 wire) of every model and in
    an MXFP8 Llama pool (tp2, MXFP8 wire) at once."""
    seed, prefix = 11, "engine-"
    kinds = (LLAMA, QWEN3, QWEN3_MOE, DSV3)
    refs = {k: model(k, seed) for k in kinds}
    engines = {(k, tp): engine(k, tp, seed + 1) for k in kinds for tp in TPS}
    lays = layouts(LLAMA, 2)
    quant = EngineModel(model(LLAMA, seed + 1), 2, 1, "vllm", shapes_of(lays), MXFP8_ENGINE)
    pools = [(k, f"tp{tp}", eng, ls, None) for (k, tp), (eng, ls) in engines.items()]
    pools.append((LLAMA, "tp2-mxfp8", quant, lays, MXFP8_ENGINE))
    workers: list[RefitdWorker | VllmWorker] = []
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(4)
    args = (qdaemon.address, seed, results, barrier, kinds, prefix)
    procs = [ctx.Process(target=trainer_rank, args=(r, *args), daemon=True) for r in range(4)]
    try:
        for k, pool, eng, ls, mx in pools:
            if eng.tp == 1:  # through the vLLM worker extension: the runner's own module
                w = VllmWorker(eng, config(k))
                workers.append(w)
                assert w.refitd_register(qdaemon.address, prefix + k, pool, 1, engine=ENGINE[k])
                continue
            for r in range(eng.tp):
                ww = RefitdWorker(qdaemon.address, prefix + k, pool, r, eng.tp, f"cpu:{r}",
                                  pause=lambda v: None, resume=lambda v: None)  # fmt: skip
                workers.append(ww)
                storage = dict.fromkeys((n for n in eng.ranks[r] if mx and n.endswith(mx)), "mxfp8")
                ww.register_engine(eng.ranks[r], ls[r], storage, eng.scales[r])
        for p in procs:
            p.start()
        got = []
        for _ in range(4 * len(kinds)):
            try:
                got.append(results.get(timeout=240))
            except queue.Empty:
                pytest.fail(f"trainer ranks did not report; got {got}")
            assert got[-1][1] != "error", got[-1][2]
        assert sorted(got) == sorted((r, k, "committed") for r in range(4) for k in kinds)
        with torch.no_grad():
            want = {k: refs[k](BATCH).logits for k in kinds}
            for k, pool, eng, _, mx in pools:
                if mx:
                    mxfp8_reference(refs[k], MXFP8_HF)
                    want[k] = refs[k](BATCH).logits
                assert torch.equal(eng.logits(BATCH), want[k]), (k, pool)
                emb = torch.cat([x["model.embed_tokens.weight"] for x in eng.ranks])
                assert bool((emb[config(k).vocab_size :] == PAD_FILL).all())
        # the quantized pool was fed over an MXFP8 wire, the others over the BF16 one
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        with httpx.Client(base_url=qdaemon.status_url.rstrip("/"), timeout=60) as http:
            for pool, wire in (("tp2-mxfp8", "mxfp8"), ("tp2", "raw")):
                params = {"model": prefix + LLAMA, "tensor": qkv, "pool": pool, "rank": 1}
                shards = http.get("/v1/explain", params=params).json()["shards"]
                assert len(shards) == 3  # q, k and v pieces of rank 1's qkv_proj
                assert {f["wire"] for s in shards for f in s["feeds"]} == {wire}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for w in workers:
            w.close() if isinstance(w, RefitdWorker) else w.refitd_close()


def test_quantized_registrations_need_scales_and_the_source_dtype() -> None:
    from refitd.client import Placed
    from refitd.client.tensors import collect

    data = torch.zeros(4, 64, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    (t,) = collect({"w": Placed(data, storage="mxfp8", scales=scales, dtype="bfloat16")})
    assert (t.dtype, t.storage, t.scales is scales) == ("bfloat16", "mxfp8", True)
    with pytest.raises(
        PlanError, match=r"'w'.*mxfp8 storage needs uint8 data and scales of shape \(4, 2\)"
    ):
        collect({"w": Placed(data, storage="mxfp8", dtype="bfloat16")})
    with pytest.raises(PlanError, match=r"'w'.*needs dtype="):
        collect({"w": Placed(data, storage="mxfp8", scales=scales)})


def assert_loaded(eng: EngineModel, hf: dict[str, torch.Tensor]) -> None:
    """Every engine tensor of every rank equals what the engine's loaders make of `hf`."""
    bad = [
        (r, n)
        for r in range(eng.tp)
        for n, want in loaded_buffers(eng, r, hf).items()
        if not torch.equal(eng.ranks[r][n], want)
    ]
    assert bad == []


@pytest.mark.parametrize(("tp", "naming"), [(2, "hf"), (4, "hf"), (2, "hf-checkpoint")])
@pytest.mark.parametrize("kind", [LLAMA, QWEN3, QWEN3_MOE, DSV3])
def test_hf_named_trainer_fills_engine_tensors_as_the_loaders_do(
    kind: str, tp: int, naming: str
) -> None:
    """A trainer named like the transformers model ("hf": fused 3-D experts) or like its
    checkpoint (per-expert experts): the engine's boxes read its tensors at their own,
    unpadded global shapes; every engine tensor then holds what vLLM's / SGLang's loaders
    put there (padding rows untouched) and the engine's logits equal the model's."""
    ref = model(kind, 0)
    sd = ref.state_dict()
    eng, lays = engine(kind, tp, 1, naming)
    fill_from(dict(sd) if naming == "hf" else hf_checkpoint_tensors(ref), eng, lays)
    assert_loaded(eng, sd)
    with torch.no_grad():
        assert torch.equal(eng.logits(BATCH), ref(BATCH).logits)


# pools fed by the FSDP2 trainer: (kind, pool, tp); tp 1 registers through the vLLM worker
# extension (vLLM layout), the others through RefitdWorker (ENGINE[kind]'s layout)
FSDP_POOLS = (
    (QWEN3, "vllm-tp1", 1), (QWEN3, "sglang-tp2", 2), (QWEN3, "sglang-tp4", 4),
    (QWEN3_MOE, "vllm-tp2-ep2", 2), (DSV3, "sglang-tp2", 2),
)  # fmt: skip


@pytest.mark.slow
def test_fsdp2_hf_trainer_refits_engine_pools_to_identical_logits(daemon: Daemon) -> None:
    """An FSDP2 trainer (fully_shard over 2 Gloo ranks) of transformers models registers
    its DTensor shards under the models' own names; engine pools laid out as vLLM / SGLang
    TP ranks (padded vocabulary, tied embeddings, KV heads replicated at tp 4, experts
    under EP, MLA) take refit v1 with source_naming="hf": every engine tensor equals what
    the engine's loaders make of the trainer's weights, and the engine's logits equal the
    sharded trainer model's."""
    seed, kinds = 21, (QWEN3, QWEN3_MOE, DSV3)
    refs = {k: model(k, seed) for k in kinds}
    pools = [(k, pool, engine(k, tp, seed + 1, "hf")) for k, pool, tp in FSDP_POOLS]
    workers: list[RefitdWorker | VllmWorker] = []
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (free_port(), daemon.address, seed, kinds, BATCH, results)
    procs = [ctx.Process(target=fsdp_trainer_rank, args=(r, *args), daemon=True) for r in (0, 1)]
    try:
        for k, pool, (eng, lays) in pools:
            if eng.tp == 1:
                w = VllmWorker(eng, config(k))
                workers.append(w)
                assert w.refitd_register(
                    daemon.address, f"fsdp-{k}", pool, 1, engine="vllm", source_naming="hf"
                )
                continue
            for r in range(eng.tp):
                ww = RefitdWorker(daemon.address, f"fsdp-{k}", pool, r, eng.tp, f"cpu:{r % 2}",
                                  pause=lambda v: None, resume=lambda v: None)  # fmt: skip
                workers.append(ww)
                ww.register_engine(eng.ranks[r], lays[r])
        for p in procs:
            p.start()
        got: dict[tuple[int, str], object] = {}
        while len(got) < 2 * len(kinds) + len(kinds):
            try:
                rank, what, value = results.get(timeout=240)
            except queue.Empty:
                pytest.fail(f"trainer ranks did not report; got {sorted(got)}")
            assert what != "error", value
            got[(rank, what)] = value
        assert {got[(r, k)] for r in (0, 1) for k in kinds} == {"committed"}
        with torch.no_grad():
            for k, pool, (eng, _) in pools:
                assert_loaded(eng, refs[k].state_dict())
                trainer_logits = got[(0, f"logits-{k}")]
                assert torch.equal(eng.logits(BATCH), trainer_logits), (k, pool)
                assert torch.equal(trainer_logits, refs[k](BATCH).logits), k
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for w in workers:
            w.close() if isinstance(w, RefitdWorker) else w.refitd_close()


def test_nvfp4_registrations_count_elements_and_need_a_global_scale() -> None:
    from refitd.client import Placed
    from refitd.client.tensors import collect

    data = torch.zeros(4, 32, dtype=torch.uint8)  # 4 x 64 elements, two per byte
    scales = torch.zeros(4, 4, dtype=torch.uint8)
    gscale = torch.zeros(1)
    (t,) = collect(
        {"w": Placed(data, storage="nvfp4", scales=scales, global_scale=gscale, dtype="bfloat16")}
    )
    assert (t.layout.local_shape, t.global_shape, t.global_scale is gscale) == (
        (4, 64),
        (4, 64),
        True,
    )
    # a TP shard: boxes and global shape count elements
    (t,) = collect(
        {
            "w": Placed(
                data,
                global_shape=(8, 64),
                boxes=[((4, 0), (4, 64), (0, 0))],
                storage="nvfp4",
                scales=scales,
                global_scale=gscale,
                dtype="bfloat16",
            )
        }
    )
    assert t.layout.local_shape == (4, 64) and t.global_shape == (8, 64)
    with pytest.raises(PlanError, match=r"'w'.*global_scale of one element goes with nvfp4"):
        collect({"w": Placed(data, storage="nvfp4", scales=scales, dtype="bfloat16")})
    with pytest.raises(
        PlanError, match=r"'w'.*nvfp4 storage needs uint8 data and scales of shape \(4, 4\)"
    ):
        collect(
            {
                "w": Placed(
                    data,
                    storage="nvfp4",
                    scales=scales[:, :2],
                    global_scale=gscale,
                    dtype="bfloat16",
                )
            }
        )
    with pytest.raises(PlanError, match=r"'w'.*global_scale of one element goes with nvfp4"):
        collect(
            {
                "w": Placed(
                    data,
                    storage="mxfp8",
                    scales=torch.zeros(4, 1, dtype=torch.uint8),
                    global_scale=gscale,
                    dtype="bfloat16",
                )
            }
        )
