"""`rdma`: one-sided writes into another slot's registered memory through Mooncake Transfer
Engine (refitd.transport.mooncake), across hosts or, over TCP, on one.

Destination, once per program load (`expose`): an endpoint of its own registers the
storages of the exposed tensors (data, scales, global scales: worker shared memory or
staging buffers) and a doorbell in ordinary memory. The descriptor body carries the
endpoint's digest-stamped segment descriptor, the doorbell's address and each tensor's
address, dtype, shape and strides. The destination's CPU takes no part in a refit.

Sender (`attach`): the path's endpoint opens the segment descriptor (one whose stamp no
longer matches the peer's live registration is refused) and every tensor is checked to lie
in registered memory. The executor addresses *mirrors*: local tensors shaped like the
destination's whose byte offsets are the destination's. `write` turns destination views
into runs of contiguous bytes and posts them as one batch, from the source itself when it
is CPU memory of the same dtype whose runs match (its storage registered once per peer),
else copied into the mirror first (casts, layouts whose runs differ). A codec landing
(a quantized destination) is encoded and landed in the mirror by the sender, then
`flush`ed. `ring` and `generation` write and read the doorbell's words remotely.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np
import torch

from refitd.plan.wire import aligned
from refitd.torch_dtypes import torch_dtype
from refitd.transport.base import DoneWork, Work
from refitd.transport.doorbell import HEADER_WORDS, MAGIC, RETIRED, Doorbell, value
from refitd.transport.errors import TransportError
from refitd.transport.mooncake import MooncakeEndpoint, MooncakeOptions, MooncakePeer
from refitd.transport.mooncake_runs import Runs, view_runs
from refitd.transport.netif import host_of
from refitd.transport.paths import (
    Exposed,
    Exposure,
    OneSidedPath,
    PathSettings,
    Peer,
    RemoteTensor,
)

CONTROL_TIMEOUT_S = 10.0  # a doorbell read or ring outside a write's deadline
OPEN_TIMEOUT_S = 10.0  # opening a peer's descriptor (probe and stamp reads)
# doorbell words rung in one control post, taken from every other scratch word from
# RING_AT on: no two are adjacent, so each stays an 8-byte write of its own
RINGS, RING_AT = 32, 2
_Spec = list[Any]  # [address, dtype name, shape, strides] of a tensor in the destination


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (what gets registered)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))


def _outermost(buffers: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Whole storages of `buffers`, one per distinct memory, none inside another."""
    by_addr: dict[int, torch.Tensor] = {}
    for t in buffers:
        w = _whole(t)
        if w.numel() and w.numel() > by_addr.get(w.data_ptr(), torch.empty(0)).numel():
            by_addr[w.data_ptr()] = w
    out: list[torch.Tensor] = []
    for addr in sorted(by_addr):
        w = by_addr[addr]
        if out and addr + w.numel() <= out[-1].data_ptr() + out[-1].numel():
            continue
        out.append(w)
    return out


def _spec(t: torch.Tensor | None) -> _Spec | None:
    if t is None:
        return None
    return [t.data_ptr(), str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride())]


def _landing_areas(sizes: dict[int, int]) -> dict[int, torch.Tensor]:
    """One buffer holding a landing area per message (segment-aligned), as views of it."""
    at, offs = 0, {}
    for mid, n in sizes.items():
        offs[mid] = (at, n)
        at += aligned(n)
    if not at:
        return {}
    whole = torch.empty(at, dtype=torch.uint8)
    return {mid: whole[a : a + n] for mid, (a, n) in offs.items()}


def _left(deadline: float) -> float:
    """Seconds to a monotonic deadline, at least a moment (a write's last chance)."""
    return max(deadline - time.monotonic(), 0.05)


def _one(local: int, remote: int, nbytes: int) -> Runs:
    return tuple(np.array([v], np.int64) for v in (local, remote, nbytes))  # type: ignore[return-value]


class RdmaExposure(Exposure):
    def __init__(
        self, body: bytes, doorbell: Doorbell, endpoint: MooncakeEndpoint, held, path: RdmaPath,
        landing: dict[int, torch.Tensor],
    ) -> None:  # fmt: skip
        self.body, self.doorbell, self.endpoint, self._held = body, doorbell, endpoint, held
        self._path: RdmaPath | None = path
        self._landing = landing

    def landing_areas(self) -> dict[int, torch.Tensor]:
        return self._landing

    def close(self) -> None:
        self.doorbell.retire()
        if self._path is not None:
            self._path.recycle(self.endpoint)
            self._path = None
        self._held = []
        self._landing = {}


class RdmaPeer(Peer):
    """A destination slot as one sender writes it (see the module docstring)."""

    in_flight = True

    def __init__(
        self, path: RdmaPath, peer: MooncakePeer, bell: int, tensors: dict[int, Any], what: str,
        landing: dict[int, tuple[int, int]],
    ) -> None:  # fmt: skip
        self.path, self.peer, self.bell, self.what = path, peer, bell, what
        self._specs, self._landing = tensors, landing
        self.one_host = host_of(peer.desc.sessions[0]) == path.settings.host
        self._tensors: dict[int, RemoteTensor] = {}
        self._mirrors: dict[int, tuple[int, int]] = {}  # storage -> (mirror, remote) address
        self._registered: set[int] = set()  # storages this peer holds registered
        # doorbell header read into words [0, 2), ring words from RING_AT on
        self._scratch = torch.zeros(RING_AT + 2 * RINGS, dtype=torch.int64)
        self._lock = threading.Lock()
        self._deadline = 0.0
        self._register(self._scratch)

    def tensor(self, index: int) -> RemoteTensor:
        t = self._tensors.get(index)
        if t is not None:
            return t
        spec = self._specs.get(index)
        if spec is None:
            raise TransportError(f"{self.what}: its descriptor exposes no tensor {index}")
        storage, parts = spec
        data, scales, gscale = (None if p is None else self._mirror(p, index) for p in parts)
        assert data is not None
        t = self._tensors[index] = RemoteTensor(f"tensor {index}", data, scales, storage, gscale)
        return t

    def _mirror(self, spec: _Spec, index: int) -> torch.Tensor:
        """A local tensor laid out as the destination's, after checking the destination's
        lies inside the memory its slot registered."""
        try:
            addr, dtype, shape, strides = int(spec[0]), torch_dtype(spec[1]), spec[2], spec[3]
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        except (ValueError, TypeError, IndexError) as e:
            raise TransportError(f"{self.what}: malformed tensor {index} ({e})") from None
        nbytes = (extent if math.prod(shape) else 0) * dtype.itemsize
        if nbytes and not self.peer.covers(addr, nbytes):
            raise TransportError(
                f"{self.what}: its tensor {index} ({nbytes} bytes at {addr:#x}) is outside "
                f"the memory slot {self.peer.slot} registered (never registered, or released)"
            )
        m = torch.empty_strided(shape, strides, dtype=dtype)
        self._mirrors[m.untyped_storage().data_ptr()] = (m.data_ptr(), addr)
        return m

    def _register(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key not in self._registered:
            self.path.acquire(t)
            self._registered.add(key)

    def post(self, dst: list[torch.Tensor], src: list[torch.Tensor], deadline: float) -> Work:
        whole: list[tuple[int, int, int]] = []  # contiguous views: one run each
        parts: list[Runs] = []
        for d, s in zip(dst, src, strict=True):
            if not d.numel():
                continue
            r = self._runs(d, s)
            if isinstance(r[2], int):
                whole.append(r)  # type: ignore[arg-type]
            else:
                parts.append(r)  # type: ignore[arg-type]
        if whole:
            local, remote, n = np.array(whole, np.int64).reshape(-1, 3).T
            parts.append((local, remote, n))
        if not parts:
            return DoneWork()
        runs = tuple(np.concatenate(col) for col in zip(*parts, strict=True))
        return self._post(runs, deadline)  # type: ignore[arg-type]

    def lands(self, mid: int) -> bool:
        return mid in self._landing

    def land(self, mid: int, at: int, buf: torch.Tensor, deadline: float) -> Work:
        """One write of a packed chunk (contiguous `buf`) into the message's landing area."""
        base, size = self._landing.get(mid, (0, 0))
        n = buf.numel() * buf.element_size()
        if not (buf.is_contiguous() and at >= 0 and at + n <= size):
            raise TransportError(
                f"{self.what}: message {mid}: a packed chunk of {n} bytes at {at} does not fit "
                f"its landing area ({size} bytes)"
            )
        self._register(buf)
        return self._post(_one(buf.data_ptr(), base + at, n), deadline)

    def write(self, dst: list[torch.Tensor], src: list[torch.Tensor], deadline: float) -> None:
        self.post(dst, src, deadline).wait(_left(deadline))

    def flush(self, views: list[torch.Tensor], deadline: float) -> None:
        self.write(views, views, deadline)

    def _runs(self, d: torch.Tensor, s: torch.Tensor) -> Runs | tuple[int, int, int]:
        """(local, remote, nbytes) of the contiguous runs that put `s` where `d` is at the
        destination: read from `s` itself when it can be, else from `d` after a copy. Both
        contiguous (most regions): one run, as plain ints."""
        mirror, remote = self._mirrors[d.untyped_storage().data_ptr()]
        item = d.element_size()
        direct = s.device.type == "cpu" and s.dtype == d.dtype and s.shape == d.shape
        if d.is_contiguous() and (s.is_contiguous() or not direct):
            if not direct:
                d.copy_(s)
                s = d
            self._register(s)
            return s.data_ptr(), d.data_ptr() - mirror + remote, d.numel() * item
        (doff,), run = view_runs(d.shape, [d.stride()])
        if direct:
            (doff, soff), joint = view_runs(d.shape, [d.stride(), s.stride()])
            direct = joint == run
        if not direct:
            d.copy_(s)
            s, soff = d, doff
        self._register(s)
        local = s.data_ptr() + soff * item
        return local, d.data_ptr() - mirror + remote + doff * item, np.full_like(doff, run * item)

    def _post(self, runs: Runs, deadline: float, read: bool = False, control: bool = False) -> Work:
        local, remote, n = runs
        if not n.size:
            return DoneWork()
        self._deadline = deadline
        # runs adjacent on both sides (e.g. tensors side by side in an arena): one request
        joined = np.ones(n.size, bool)
        joined[0] = False
        ends_l, ends_r = local[:-1] + n[:-1], remote[:-1] + n[:-1]
        joined[1:] = (ends_l == local[1:]) & (ends_r == remote[1:])
        if joined.any():
            first = np.flatnonzero(~joined)
            local, remote, n = local[first], remote[first], np.add.reduceat(n, first)
        return self.peer.post((local, remote, n), _left(deadline), read=read, control=control)

    def _control_deadline(self) -> float:
        return max(self._deadline, time.monotonic() + CONTROL_TIMEOUT_S)

    def ring(self, entry: int, attempt: int, chunks: int) -> None:
        self.ring_many([(entry, attempt, chunks)])

    def ring_many(self, rings: list[tuple[int, int, int]]) -> None:
        """The doorbell words of several messages, RINGS at a time in one control post."""
        for k in range(0, len(rings), RINGS):
            with self._lock:
                deadline = self._control_deadline()
                self._post_rings(rings[k : k + RINGS], deadline).wait(_left(deadline))

    def ring_current(self, generation: int, rings: list[tuple[int, int, int]]) -> bool:
        """The header read posted with the first RINGS rings (one round trip over the
        link, where the writes just queued), the rest once the generation matched."""
        with self._lock:
            deadline = self._control_deadline()
            gen = self._generation(deadline, self._post_rings(rings[:RINGS], deadline))
        if gen != generation:
            return False
        self.ring_many(rings[RINGS:])
        return True

    def _post_rings(self, part: list[tuple[int, int, int]], deadline: float) -> Work:
        """Post up to RINGS doorbell words (under the lock: they are staged in scratch)."""
        self._scratch[RING_AT : RING_AT + 2 * len(part) : 2] = torch.tensor(
            [value(a, c) for _, a, c in part], dtype=torch.int64
        )
        local = self._scratch.data_ptr() + 8 * RING_AT + 16 * np.arange(len(part))
        remote = self.bell + 8 * (HEADER_WORDS + np.array([e for e, _, _ in part]))
        runs = (local.astype(np.int64), remote.astype(np.int64), np.full(len(part), 8))
        return self._post(runs, deadline, control=True)

    def _generation(self, deadline: float, beside: Work | None = None) -> int:
        """Read the doorbell's header (under the lock), waiting for `beside` (posted
        rings) too: its generation, RETIRED where it is no live doorbell."""
        self._scratch[0:2] = 0
        op = _one(self._scratch.data_ptr(), self.bell, 16)
        read = self._post(op, deadline, read=True, control=True)
        if beside is not None:
            beside.wait(_left(deadline))
        read.wait(_left(deadline))
        magic, gen = (int(x) for x in self._scratch[0:2].tolist())
        return gen if magic == MAGIC else RETIRED

    def generation(self) -> int:
        with self._lock:
            return self._generation(self._control_deadline())

    def check_live(self) -> None:
        """Nothing to check locally: the doorbell read (`generation`) before each refit
        finds a destination that unloaded, reloaded or went away."""

    def close(self) -> None:
        for key in self._registered:
            self.path.release(key)
        self._registered.clear()
        self._tensors.clear()
        self._mirrors.clear()


class RdmaPath(OneSidedPath):
    """The rdma path of one transfer process: an endpoint per exposure (destination), one
    shared by its peers (sender), whose registrations are counted per storage."""

    kind = "rdma"
    packs = True

    def __init__(self, settings: PathSettings | None = None) -> None:
        super().__init__(settings)
        self._sender: MooncakeEndpoint | None = None
        self._held: dict[int, list[Any]] = {}  # storage address -> [count, registered tensor]
        self._spare: list[MooncakeEndpoint] = []  # of closed exposures, registering nothing
        self._closed = False
        self._lock = threading.Lock()

    def options(self) -> MooncakeOptions:
        s = self.settings
        return MooncakeOptions(protocol=s.rdma_protocol, devices=s.rdma_devices, host=s.host)

    def expose(
        self, tensors: dict[int, Exposed], entries: int, generation: int,
        landing: dict[int, int] | None = None,
    ) -> Exposure:  # fmt: skip
        words = torch.zeros(HEADER_WORDS + entries, dtype=torch.int64)
        bell = Doorbell(words.numpy())
        bell.init(generation, entries)
        parts = [p for t in tensors.values() for p in (t.data, t.scales, t.global_scale)]
        areas = _landing_areas(landing or {})
        held = _outermost([words, *areas.values(), *(p for p in parts if p is not None)])
        with self._lock:
            spare = self._spare.pop() if self._spare else None
        endpoint = spare or MooncakeEndpoint(self.settings.slot, self.options())
        try:
            endpoint.register(held, f"{generation:x}")
            specs = {
                int(i): [t.storage, [_spec(p) for p in (t.data, t.scales, t.global_scale)]]
                for i, t in tensors.items()
            }
            lands = {m: [a.data_ptr(), a.numel()] for m, a in areas.items()}
            body = msgpack.packb(
                {"segment": endpoint.descriptor(), "doorbell": words.data_ptr(), "tensors": specs,
                 "landing": lands},
                use_bin_type=True,
            )  # fmt: skip
        except BaseException:
            self.recycle(endpoint)
            raise
        return RdmaExposure(body, bell, endpoint, held, self, areas)

    def recycle(self, endpoint: MooncakeEndpoint) -> None:
        """A closed exposure's endpoint: its registration dropped (descriptors of it are
        refused from now on: their stamp no longer matches), its engines kept for the next
        exposure. A new program load then neither tears engines down (which holds the
        interpreter for a large part of a second each on a busy host) nor starts new ones."""
        endpoint.unregister()
        with self._lock:
            if not self._closed:
                self._spare.append(endpoint)
                return
        endpoint.close()

    def attach(self, body: bytes, what: str) -> Peer:
        try:
            d = msgpack.unpackb(body, raw=False, strict_map_key=False)
            segment, bell = bytes(d["segment"]), int(d["doorbell"])
            tensors = {int(i): (str(s), p) for i, (s, p) in d["tensors"].items()}
            landing = {int(m): (int(a), int(n)) for m, (a, n) in d.get("landing", {}).items()}
        except Exception as e:
            raise TransportError(f"{what}: malformed rdma descriptor ({e})") from None
        try:
            peer = self._endpoint().open(segment, timeout_s=OPEN_TIMEOUT_S)
        except TransportError as e:
            raise TransportError(f"{what}: descriptor refused: {e}") from None
        if not peer.covers(bell, 8 * HEADER_WORDS):
            raise TransportError(f"{what}: its doorbell is outside the memory it registered")
        outside = [m for m, (a, n) in landing.items() if not peer.covers(a, n)]
        if outside:
            raise TransportError(
                f"{what}: the landing areas of messages {sorted(outside)[:4]} are outside the "
                "memory it registered"
            )
        return RdmaPeer(self, peer, bell, tensors, what, landing)

    def _endpoint(self) -> MooncakeEndpoint:
        with self._lock:
            if self._sender is None:
                self._sender = MooncakeEndpoint(self.settings.slot, self.options())
            return self._sender

    def acquire(self, t: torch.Tensor) -> None:
        """Register the storage of `t` with the sender's endpoint (counted)."""
        endpoint = self._endpoint()
        whole = _whole(t)
        with self._lock:
            entry = self._held.get(whole.data_ptr())
            if entry is None:
                endpoint.add_local(whole)
                entry = self._held[whole.data_ptr()] = [0, whole]
            entry[0] += 1

    def release(self, key: int) -> None:
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0 and self._sender is not None:
                self._sender.remove_local(entry[1])
                del self._held[key]

    def close(self) -> None:
        """Drop the sender's endpoint and the spare ones (when the transfer process closes:
        a reconnect keeps the path). Engine teardown (unregistering, stopping threads) takes
        about a second each on a busy host and runs on a thread of its own; an endpoint
        holds what it registered until it is done."""
        with self._lock:
            sender, self._sender = self._sender, None
            spare, self._spare, self._closed = self._spare, [], True
            self._held.clear()
        for endpoint in [*spare, *([sender] if sender is not None else [])]:
            threading.Thread(target=endpoint.close, name="mooncake-close", daemon=True).start()
