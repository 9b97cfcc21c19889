"""`gloo`: CPU tensors over TCP through a torch ProcessGroupGloo.

The group is built directly from a TCPStore client and a per-epoch PrefixStore, so there is
no default process group and no global state; it is made once per epoch and reused for every
refit. CUDA tensors are staged through pinned host buffers.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress

import torch
import torch.distributed as dist

from refitd.transport.base import ConnectInfo, Transport, TransportError, Work, check_buffer


def epoch_prefix(info: ConnectInfo) -> str:
    """Store prefix of one epoch's communicator (the token keeps clusters apart)."""
    token = f"{info.store_token}/" if info.store_token else ""
    return f"refitd/{token}epoch{info.epoch}"


def open_store(info: ConnectInfo) -> dist.Store:
    """A client of the controller's rendezvous TCPStore, scoped to info's epoch."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    try:
        store = dist.TCPStore(
            info.store_host,
            info.store_port,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as e:  # torch raises several types (RuntimeError, DistNetworkError)
        raise TransportError(
            f"rank {info.rank}: cannot reach rendezvous store {info.store_host}:{info.store_port} "
            f"within {info.timeout_s}s: {e}"
        ) from e
    return dist.PrefixStore(epoch_prefix(info), store)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _GlooWork:
    def __init__(
        self,
        work: dist.Work,
        what: str,
        after: torch.Tensor | None = None,
        staged: torch.Tensor | None = None,
    ) -> None:
        self._work = work
        self._what = what
        self._after = after
        self._staged = staged

    def wait(self, timeout_s: float) -> None:
        try:
            ok = self._work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as e:
            raise TransportError(f"{self._what} failed: {e}") from e
        if ok is False:
            raise TransportError(f"{self._what} did not complete within {timeout_s:.1f}s")
        if self._after is not None and self._staged is not None:
            self._after.copy_(self._staged)


class GlooTransport(Transport):
    """One rank of a Gloo communicator for one membership epoch."""

    name = "gloo"

    def __init__(self) -> None:
        self._pg: dist.ProcessGroupGloo | None = None
        self._info: ConnectInfo | None = None

    def connect(self, info: ConnectInfo) -> None:
        self.close()
        store = open_store(info)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=info.timeout_s)
        if _is_loopback(info.store_host):
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        try:
            self._pg = dist.ProcessGroupGloo(store, info.rank, info.world_size, opts)
        except Exception as e:
            raise TransportError(
                f"rank {info.rank}/{info.world_size}: gloo communicator of epoch {info.epoch} "
                f"not formed within {info.timeout_s}s (a peer did not join?): {e}"
            ) from e
        self._info = info

    @property
    def rank(self) -> int:
        if self._info is None:
            raise TransportError("gloo transport is not connected")
        return self._info.rank

    def _group(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise TransportError("gloo transport is not connected")
        return self._pg

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        check_buffer(tensor, f"send tag {tag} to rank {peer}")
        what = f"gloo send tag {tag} to rank {peer}"
        if tensor.is_cuda:
            host = torch.empty(tensor.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(tensor)
            tensor = host
        try:
            return _GlooWork(self._group().send([tensor], peer, tag), what)
        except Exception as e:
            raise TransportError(f"{what}: {e}") from e

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        check_buffer(tensor, f"recv tag {tag} from rank {peer}")
        what = f"gloo recv tag {tag} from rank {peer}"
        target, staged = None, None
        if tensor.is_cuda:
            target = tensor
            staged = torch.empty(tensor.numel(), dtype=torch.uint8, pin_memory=True)
            tensor = staged
        try:
            return _GlooWork(self._group().recv([tensor], peer, tag), what, target, staged)
        except Exception as e:
            raise TransportError(f"{what}: {e}") from e

    def close(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.abort()
        self._pg = None
        self._info = None
