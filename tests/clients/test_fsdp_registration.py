"""An FSDP2 module registers correctly at any point of its life: right after fully_shard,
after an eval forward (the root's parameters left unsharded), after a training step, and
with layers under torch.compile. Two real Gloo ranks keep training after registration and refit an inference
rank; the engine's bytes must equal FSDP2's full_tensor() bit for bit, and the trainer's
next forward must equal a plain model loaded with those bytes (so the trainer still trains
on the registered memory). The engine holds two tensors as non-contiguous views."""

from __future__ import annotations

import io
import queue

import pytest
import torch
import torch.multiprocessing as mp
from _adapter_models import subscribed
from _fsdp_workers import SCENARIOS, TOKENS, TinyLm, fsdp_trainer_rank, global_shapes

from refitd.client import InferenceClient, Placed
from refitd.demo.run import Daemon, free_port


def _engine_tensors() -> dict[str, torch.Tensor]:
    """Zeroed destinations; lm_head is the transpose of a [hidden, vocab] buffer and
    embed_tokens every other column of a wider one (strided, non-contiguous)."""
    out = {n: torch.zeros(s) for n, s in global_shapes().items()}
    vocab, hidden = out["lm_head.weight"].shape
    out["lm_head.weight"] = torch.zeros(hidden, vocab).t()
    out["embed_tokens.weight"] = torch.zeros(vocab, 2 * hidden)[:, ::2]
    assert not out["lm_head.weight"].is_contiguous()
    assert not out["embed_tokens.weight"].is_contiguous()
    return out


def _reports(results: mp.Queue, count: int) -> list[tuple[int, str, str, bytes]]:
    got: list[tuple[int, str, str, bytes]] = []
    while len(got) < count:
        try:
            got.append(results.get(timeout=120))
        except queue.Empty:
            pytest.fail(f"trainer ranks reported {[g[:3] for g in got]} of {count} reports")
        if got[-1][1] == "error":
            pytest.fail(f"trainer rank {got[-1][0]} failed:\n{got[-1][3].decode()}")
    return got


@pytest.mark.slow
def test_fsdp2_registered_after_forwards_ships_and_trains_on_the_same_weights(
    daemon: Daemon,
) -> None:
    engines = {s: _engine_tensors() for s in SCENARIOS}
    infer = [
        InferenceClient(daemon.address, f"fsdp-{s}", "infer", rank=0, pool_size=1, device="cpu:2")
        for s in SCENARIOS
    ]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=fsdp_trainer_rank, args=(r, port, daemon.address, results))
        for r in range(2)
    ]
    try:
        for client, s in zip(infer, SCENARIOS, strict=True):
            client.register({n: Placed(t) for n, t in engines[s].items()})
            subscribed(client)
        for p in procs:
            p.start()
        reports = _reports(results, 2 * len(SCENARIOS))
        problems: list[str] = []
        for rank, scenario, state, blob in sorted(reports):
            got = torch.load(io.BytesIO(blob))
            engine = engines[scenario]
            differ = [n for n, t in got["full"].items() if not torch.equal(engine[n], t)]
            reference = TinyLm()
            reference.load_state_dict({n: t.contiguous() for n, t in engine.items()})
            with torch.no_grad():
                gap = (got["logits"] - reference(TOKENS)).abs().max().item()
            if state != "committed" or differ or gap:
                problems.append(
                    f"{scenario}, rank {rank}: refit {state}; engine bytes differ from "
                    f"full_tensor() for {differ}; trainer logits off by {gap}"
                )
        assert not problems, "\n".join(problems)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for c in infer:
            c.close()
