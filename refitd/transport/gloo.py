"""`gloo`: CPU tensors over TCP through a torch ProcessGroupGloo.

The group is built directly from a TCPStore client and a per-epoch PrefixStore, so there is
no default process group and no global state; it is made once per epoch and reused for every
refit. CUDA tensors are staged through pinned host buffers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time

import torch
import torch.distributed as dist

from refitd.transport.base import ConnectInfo, Transport, TransportError, Work, check_buffer
from refitd.transport.netif import host_of, is_loopback


def epoch_prefix(info: ConnectInfo) -> str:
    """Store prefix of one epoch's communicator (the token keeps clusters apart)."""
    token = f"{info.store_token}/" if info.store_token else ""
    return f"refitd/{token}epoch{info.epoch}"


def open_store(info: ConnectInfo) -> dist.Store:
    """A client of the controller's rendezvous TCPStore, scoped to info's epoch."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    start = time.monotonic()
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
            f"rank {info.rank}: cannot reach rendezvous store {info.store_host}:{info.store_port}"
            f" ({outcome(time.monotonic() - start, info.timeout_s)}): {e}"
        ) from e
    return dist.PrefixStore(epoch_prefix(info), store)


def outcome(elapsed_s: float, timeout_s: float) -> str:
    """'timed out after 20.0s' or 'failed after 0.03s (timeout 20s)': which one it was."""
    if elapsed_s >= 0.95 * timeout_s:
        return f"timed out after {elapsed_s:.1f}s"
    return f"failed after {elapsed_s:.2f}s of its {timeout_s:g}s timeout"


PEER_RE = re.compile(r"remote=(\[[^\]]*\]:\d+|[^\s,]+)")


def describe_failure(
    what: str, info: ConnectInfo, local: str, elapsed_s: float, error: BaseException
) -> str:
    """What failed, where (this rank's address, the peer's when the error names it) and
    after how long, e.g. a refused connection after 0.03 s rather than "not formed in 20 s"."""
    text = str(error).strip().splitlines()
    first = text[0] if text else repr(error)
    peer = PEER_RE.search(str(error))
    where = f"rank {info.rank}/{info.world_size} at {local}"
    if peer:
        where += f" -> peer {peer.group(1)}"
    why = first if len(first) < 400 else first[:400] + "..."
    hint = ""
    if peer and is_loopback(host_of(peer.group(1))):
        hint = (
            "; the peer advertised a loopback address: set its agent's --data-plane-address "
            "or --data-plane-interface"
        )
    elif elapsed_s >= 0.95 * info.timeout_s:
        hint = "; a peer did not join (its agent down or unreachable?)"
    return (
        f"{where}: {what} of epoch {info.epoch} {outcome(elapsed_s, info.timeout_s)}: {why}{hint}"
    )


def gloo_device(info: ConnectInfo) -> tuple[object, str]:
    """The Gloo device peers connect to, and where it listens (for messages): the agent's
    data-plane interface or address; else GLOO_SOCKET_IFNAME; else loopback for a loopback
    store; else torch's default device (hostname resolution: only without an agent)."""
    create = dist.ProcessGroupGloo.create_device
    if info.local_interface:
        return create(interface=info.local_interface), f"{info.local_interface}"
    if info.local_address:
        return create(hostname=info.local_address), info.local_address
    env_if = (os.environ.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    if env_if:
        return create(interface=env_if), env_if
    if is_loopback(info.store_host):
        return create(hostname="127.0.0.1"), "127.0.0.1"
    return dist.ProcessGroupGloo.create_default_device(), "the host name's address"


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
        start = time.monotonic()
        try:
            device, local = gloo_device(info)
        except Exception as e:
            raise TransportError(
                f"rank {info.rank}: no gloo device on the data plane "
                f"({info.local_interface or info.local_address or 'default'}): {e}"
            ) from e
        opts._devices = [device]
        try:
            self._pg = dist.ProcessGroupGloo(store, info.rank, info.world_size, opts)
        except Exception as e:
            elapsed = time.monotonic() - start
            raise TransportError(
                describe_failure("gloo communicator", info, local, elapsed, e)
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
