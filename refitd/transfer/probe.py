"""The probe command: raw link and memcpy references for benchmarks, timed in the transfer
process between the same ranks (and on the same device) as the refit they are compared to."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from refitd.memory.segments import shared_buffer
from refitd.slot_protocol import Probe, Probed
from refitd.transport.errors import TransportError

if TYPE_CHECKING:
    from refitd.transfer.slot import TransferSlot


def probe(state: TransferSlot, cmd: Probe) -> Probed:
    """Seconds of `repeat` sends/receives per peer (or of `repeat` memcpys). `prepare` only
    allocates (and drops other buffers); buffers live until `release`, so freeing them is
    never timed (both answer 0.0 seconds)."""
    if cmd.release:
        state.probe_bufs = {k: v for k, v in state.probe_bufs.items() if k[0] == "k"}
        return Probed(0.0)
    if cmd.memcpy is not None:
        return _memcpy(state, cmd, cmd.memcpy)
    if state.transport is None:
        raise TransportError("probe needs a connected transport")
    want = [("s", int(p), n, r) for p, (n, r) in cmd.sends.items()]
    want += [("r", int(p), n, r) for p, (n, r) in cmd.recvs.items()]
    if cmd.prepare:
        keep = {(kind, peer) for kind, peer, _, _ in want}
        state.probe_bufs = {k: v for k, v in state.probe_bufs.items() if k in keep}
    for kind, peer, n, _ in want:
        buf = state.probe_bufs.get((kind, peer))
        if buf is None or buf.numel() != n:
            state.probe_bufs[(kind, peer)] = _probe_buffer(n, torch.device("cpu"))
    if cmd.prepare:
        return Probed(0.0)
    t0 = time.monotonic()
    works = []
    for k in range(max((w[3] for w in want), default=0)):
        for kind, peer, _, repeat in want:
            if k >= repeat:
                continue
            buf = state.probe_bufs[(kind, peer)]
            tag = 0x7FFF0000 + k
            if kind == "s":
                works.append(state.transport.isend(buf, peer, tag))
            else:
                works.append(state.transport.irecv(buf, peer, tag))
    for w in works:
        w.wait(cmd.timeout_s - (time.monotonic() - t0))
    return Probed(time.monotonic() - t0)


def _memcpy(state: TransferSlot, cmd: Probe, n: int) -> Probed:
    dev = torch.device(cmd.device)
    kind = "k" if cmd.kept else "m"
    if cmd.prepare and not cmd.kept:
        state.probe_bufs = {k: v for k, v in state.probe_bufs.items() if k[0] in "mk"}
    a = state.probe_bufs.get((kind, 0))
    if a is None or a.numel() < n or a.device != dev or (a.numel() != n and not cmd.kept):
        a = state.probe_bufs[(kind, 0)] = _probe_buffer(n, dev)
        state.probe_bufs[(kind, 1)] = _probe_buffer(n, dev)
    a, b = a[:n], state.probe_bufs[(kind, 1)][:n]
    if cmd.prepare:
        return Probed(0.0)
    piece = cmd.memcpy_piece or n

    def copies() -> None:
        for _ in range(cmd.repeat):
            for i in range(0, n, piece):
                b[i : i + piece].copy_(a[i : i + piece])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # on a thread of its own, as a refit's copies run (torch's intra-op threads are set up
    # per calling thread; on a loaded 2-core VM the command loop's are measurably slower)
    t0 = time.monotonic()
    worker = threading.Thread(target=copies, name="refitd-probe-memcpy")
    worker.start()
    worker.join()
    return Probed(time.monotonic() - t0)


def _probe_buffer(n: int, dev: torch.device) -> torch.Tensor:
    """A probe buffer of ones; on the CPU in shared memory pages, like worker tensors."""
    if dev.type == "cpu":
        return shared_buffer(n).fill_(1)
    return torch.ones(n, dtype=torch.uint8, device=dev)
