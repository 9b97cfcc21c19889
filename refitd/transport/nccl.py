"""`nccl`: GPU tensors through a torch ProcessGroupNCCL, point-to-point ops batched.

Built from the same per-epoch PrefixStore as gloo, with no default process group. A batch
of sends and receives is posted between `_start_coalescing`/`_end_coalescing` (what
torch.distributed.batch_isend_irecv does), so NCCL runs them as one group call. Runs only
where CUDA and NCCL are present.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist

from refitd.transport.base import ConnectInfo, P2POp, Transport, TransportError, Work, check_buffer
from refitd.transport.gloo import describe_failure, open_store
from refitd.transport.netif import interface_of


def nccl_interface(info: ConnectInfo) -> str:
    """NCCL reads NCCL_SOCKET_IFNAME itself; when unset, point it at the agent's data-plane
    interface (named, or the one holding its data-plane address) before the first init."""
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        return os.environ["NCCL_SOCKET_IFNAME"]
    iface = info.local_interface
    if not iface and info.local_address:
        iface = interface_of(info.local_address)
    if iface:
        os.environ["NCCL_SOCKET_IFNAME"] = iface
    return iface


class _NcclWork:
    def __init__(self, work: dist.Work | None, what: str, device: torch.device) -> None:
        self._work = work
        self._what = what
        self._device = device

    def wait(self, timeout_s: float) -> None:
        if self._work is None:
            return
        try:
            ok = self._work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as e:
            raise TransportError(f"{self._what} failed: {e}") from e
        if ok is False:
            raise TransportError(f"{self._what} did not complete within {timeout_s:.1f}s")
        # The work's wait only orders the current stream after NCCL's; make it host-visible.
        torch.cuda.current_stream(self._device).synchronize()


class NcclTransport(Transport):
    """One rank of an NCCL communicator for one membership epoch, on the current CUDA device."""

    name = "nccl"

    def __init__(self) -> None:
        self._pg: dist.ProcessGroupNCCL | None = None
        self._info: ConnectInfo | None = None
        self._device = torch.device("cuda", 0)

    def connect(self, info: ConnectInfo) -> None:
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise TransportError("nccl transport needs a CUDA build of torch and a GPU")
        self.close()
        self._device = torch.device("cuda", torch.cuda.current_device())
        store = open_store(info)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=info.timeout_s)
        local = nccl_interface(info) or info.local_address or "NCCL's default interface"
        start = time.monotonic()
        try:
            self._pg = dist.ProcessGroupNCCL(store, info.rank, info.world_size, opts)
        except Exception as e:
            elapsed = time.monotonic() - start
            raise TransportError(
                describe_failure("nccl communicator", info, local, elapsed, e)
            ) from e
        self._info = info

    @property
    def rank(self) -> int:
        if self._info is None:
            raise TransportError("nccl transport is not connected")
        return self._info.rank

    def _group(self) -> dist.ProcessGroupNCCL:
        if self._pg is None:
            raise TransportError("nccl transport is not connected")
        return self._pg

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self.batch([P2POp(True, tensor, peer, tag)])[0]

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        return self.batch([P2POp(False, tensor, peer, tag)])[0]

    def batch(self, ops: list[P2POp]) -> list[Work]:
        pg = self._group()
        for op in ops:
            check_buffer(op.tensor, f"nccl op tag {op.tag} with rank {op.peer}")
            if not op.tensor.is_cuda:
                raise TransportError(f"nccl op tag {op.tag}: buffer is not on a CUDA device")
        what = ", ".join(f"{'send' if o.send else 'recv'} tag {o.tag} rank {o.peer}" for o in ops)
        try:
            _coalescing(pg, "_start_coalescing", self._device)
            for op in ops:
                if op.send:
                    pg.send([op.tensor], op.peer, 0)
                else:
                    pg.recv([op.tensor], op.peer, 0)
            work = _coalescing(pg, "_end_coalescing", self._device)
        except Exception as e:
            raise TransportError(f"nccl batch ({what}): {e}") from e
        shared = _NcclWork(work, f"nccl batch ({what})", self._device)
        return [shared for _ in ops]

    def close(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.abort()
        self._pg = None
        self._info = None


def _coalescing(pg: object, method: str, device: torch.device) -> object:
    """Call a coalescing hook of a NCCL backend.

    A bare ProcessGroupNCCL backend takes no device (torch 2.11); the ProcessGroup wrapper of
    some releases takes one.
    """
    fn = getattr(pg, method)
    try:
        return fn()
    except TypeError:
        return fn(device)
