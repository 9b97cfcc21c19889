"""One-sided paths: a sender writes straight into a destination slot's registered memory.

A path kind implements `OneSidedPath` (the `mapped` path in refitd.transfer.mapped_path,
beside worker memory; a remote-memory path such as RDMA plugs in the same way; the
transfer process names them in refitd.transfer.links.PATH_KINDS):
- on the destination, once per program load, `expose` makes the tensors that senders write
  reachable (mapped: nothing to do, worker memory is shared memory or exported by CUDA IPC
  and staging buffers are made shareable; a remote path registers the memory with its
  engine) and creates the doorbell it receives completions on (doorbell.py); the framework
  publishes the `Descriptor` (the path's body in an envelope naming kind, communicator epoch,
  plan digest, slot, doorbell generation and the message of every doorbell entry) in the
  rendezvous store under the epoch's prefix;
- on a sender, once per loaded plan, `Links.fetch` reads the descriptor back (checked
  against what the sender expects) and `attach` turns its body into a `Peer`: the
  destination's tensors as views the sender slices (`tensor`), `write` and `post` (copy
  source views into destination views, waiting or not), `ring` (a message's chunks landed) and `generation` (the
  doorbell's current generation: a destination that reloaded or unloaded the plan shows
  another one, so a stale descriptor is never written through).

Descriptors go through the store rather than the controller's LoadProgram because what
they carry exists only in the destination's transfer process after its load: the doorbell,
the staging buffers of a staged pool, and (for a remote path) the engine's registration;
keying them by communicator epoch and plan digest makes a reconnect or a new plan
invisible to stale readers. The controller never sees them.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import torch

from refitd.transport.base import ConnectInfo, DoneWork, Work
from refitd.transport.doorbell import Doorbell
from refitd.transport.errors import TransportError

DESCRIPTOR_VERSION = 1
STORE_VALUE_BYTES = 4 << 20  # a descriptor part: half of the largest value TCPStore takes
PARTS_MAGIC = b"refitd-parts:"  # a header naming the parts of a larger descriptor


@dataclass(frozen=True, slots=True)
class PathSettings:
    """What a transfer process's paths take from its agent: its slot, the data-plane
    address peers reach it at, and the rdma path's protocol and devices."""

    slot: int = 0
    host: str = "127.0.0.1"
    rdma_protocol: str = "tcp"
    rdma_devices: tuple[str, ...] = ()
    rdma_landing_bytes: int = 1 << 30  # cap on a destination's landing areas (packed writes)


@dataclass(frozen=True, slots=True)
class Exposed:
    """A destination tensor a path exposes: its memory (data and, quantized, scales and
    nvfp4's global scale) in this process, its storage name, and the memory handle a
    process on the same host maps it by (the worker's, or the staging buffer's)."""

    data: torch.Tensor
    scales: torch.Tensor | None
    storage: str
    handle: bytes
    global_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class RemoteTensor:
    """A destination tensor as a sender addresses it (views of it are write targets)."""

    name: str
    data: torch.Tensor
    scales: torch.Tensor | None
    storage: str
    global_scale: torch.Tensor | None = None  # nvfp4 storage: its float32 global scale


class Exposure(abc.ABC):
    """What a destination slot made reachable for one loaded plan."""

    body: bytes  # the path's part of the descriptor
    doorbell: Doorbell

    @abc.abstractmethod
    def close(self) -> None:
        """Retire the doorbell (senders holding this descriptor refuse it) and release."""

    def landing_areas(self) -> dict[int, torch.Tensor]:
        """Message id -> the landing area its packed chunks arrive in (see `OneSidedPath.
        packs`); the receiver scatters each chunk from there once its doorbell shows it."""
        return {}


class Peer(abc.ABC):
    """A destination slot's exposed memory as one sender reaches it."""

    in_flight = False  # `post` returns while the writes are on the wire (a remote path)
    one_host = True  # the destination's data-plane address is this sender's

    @abc.abstractmethod
    def tensor(self, index: int) -> RemoteTensor:
        """Plan tensor `index` of the destination (TransportError when not exposed)."""

    @abc.abstractmethod
    def write(self, dst: list[torch.Tensor], src: list[torch.Tensor], deadline: float) -> None:
        """Copy each source view into its destination view (views of `tensor()`s), done by
        the monotonic `deadline` (TransportError otherwise)."""

    def post(self, dst: list[torch.Tensor], src: list[torch.Tensor], deadline: float) -> Work:
        """Start `write`; the Work completes once every byte landed. A path whose copies
        complete as they are made (mapped memory) writes here and returns a done Work; a
        remote path returns while its writes are in flight, so the sender prepares the
        next chunk meanwhile."""
        self.write(dst, src, deadline)
        return DoneWork()

    def lands(self, mid: int) -> bool:
        """Whether message `mid` goes packed into a landing area of the destination's."""
        return False

    def land(self, mid: int, at: int, buf: torch.Tensor, deadline: float) -> Work:
        """Start writing the packed bytes `buf` at offset `at` of message `mid`'s landing
        area; the Work completes once they landed."""
        raise TransportError(f"message {mid}: the destination exposed no landing area for it")

    def flush(self, views: list[torch.Tensor], deadline: float) -> None:  # noqa: B027
        """Views of `tensor()`s the sender wrote in place (a codec's landing) reach the
        destination (a path whose tensors are the destination's memory: nothing to do)."""

    @abc.abstractmethod
    def ring(self, entry: int, attempt: int, chunks: int) -> None:
        """Chunks [0, chunks) of the message at doorbell `entry` landed."""

    def ring_many(self, rings: list[tuple[int, int, int]]) -> None:
        """`ring` for each (entry, attempt, chunks); a remote path rings them in one round
        trip."""
        for entry, attempt, chunks in rings:
            self.ring(entry, attempt, chunks)

    @abc.abstractmethod
    def generation(self) -> int:
        """The destination doorbell's generation now (doorbell.RETIRED once retired)."""

    def ring_current(self, generation: int, rings: list[tuple[int, int, int]]) -> bool:
        """`ring_many` where the destination's doorbell shows `generation` (it still holds
        the plan the writes were for); False where it does not. A remote path reads the
        generation and rings in one round trip, so its ring may reach a doorbell of
        another generation: that doorbell's waiters expect other attempt ids, so the
        ring completes none of their waits."""
        if self.generation() != generation:
            return False
        self.ring_many(rings)
        return True

    @abc.abstractmethod
    def check_live(self) -> None:
        """Raise (StorageMovedError, TransportError) if exposed memory was released."""

    def close(self) -> None:  # noqa: B027 - optional
        """Drop mappings or connections."""


class OneSidedPath(abc.ABC):
    """One kind of one-sided path (see the module docstring)."""

    kind: str = ""
    # the destination lands messages of short runs (strided regions) packed in a landing
    # area and scatters them itself: a path whose writes cost per request (a remote one)
    packs = False

    def __init__(self, settings: PathSettings | None = None) -> None:
        self.settings = settings or PathSettings()

    def close(self) -> None:  # noqa: B027 - optional
        """Release what the path holds for the transfer process (engines, registrations)."""

    @abc.abstractmethod
    def expose(
        self, tensors: dict[int, Exposed], entries: int, generation: int,
        landing: dict[int, int] | None = None,
    ) -> Exposure:  # fmt: skip
        """Destination side, once per program load: `tensors` reachable, a doorbell of
        `entries` words with `generation`, and (a path that `packs`) a landing area of
        `landing[mid]` bytes per message that lands packed."""

    @abc.abstractmethod
    def attach(self, body: bytes, what: str) -> Peer:
        """Sender side: the peer a descriptor body describes (`what` names it in errors)."""


@dataclass(frozen=True)
class Descriptor:
    """What a sender needs to write into a destination slot under one plan."""

    kind: str
    epoch: int
    digest: str
    slot: int
    generation: int
    messages: tuple[int, ...]  # message id of each doorbell entry
    body: bytes
    entry: dict[int, int] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.entry.update({m: k for k, m in enumerate(self.messages)})

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [DESCRIPTOR_VERSION, self.kind, self.epoch, self.digest, self.slot,
             self.generation, list(self.messages), self.body],
            use_bin_type=True,
        )  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> Descriptor:
        try:
            v, kind, epoch, digest, slot, gen, messages, body = msgpack.unpackb(data, raw=False)
        except Exception as e:
            raise TransportError(f"{what}: malformed descriptor ({e})") from None
        if v != DESCRIPTOR_VERSION:
            raise TransportError(f"{what}: descriptor format {v!r}, expected {DESCRIPTOR_VERSION}")
        return cls(kind, epoch, digest, slot, gen, tuple(messages), body)


def descriptor_key(kind: str, digest: str, slot: int) -> str:
    return f"links/{kind}/{digest}/slot{slot}"


class Links:
    """The one-sided paths of one transfer process in one communicator epoch, and the
    descriptors they exchange through the rendezvous store (opened on first use)."""

    def __init__(
        self,
        info: ConnectInfo,
        open_store: Callable[[ConnectInfo], object],
        make_path: Callable[[str], OneSidedPath],
    ) -> None:
        """`make_path(kind)`: the path of that kind, owned by the caller (TransportError when
        unknown)."""
        self.info = info
        self._open_store = open_store
        self._make_path = make_path
        self._store: object | None = None
        self._paths: dict[str, OneSidedPath] = {}
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        return self.info.epoch

    def path(self, kind: str) -> OneSidedPath:
        with self._lock:
            p = self._paths.get(kind)
            if p is None:
                p = self._paths[kind] = self._make_path(kind)
            return p

    def _client(self) -> object:
        with self._lock:
            if self._store is None:
                self._store = self._open_store(self.info)
            return self._store

    def publish(self, d: Descriptor) -> None:
        """Put a destination's descriptor in the store (replacing an older one). One larger
        than a store value may be (torch's TCPStore refuses values over 8 MiB) goes in
        parts under keys of its own, then a small header under the descriptor's key names
        them: a reader sees the old descriptor or the whole new one."""
        key = descriptor_key(d.kind, d.digest, d.slot)
        raw = d.to_bytes()
        try:
            store = self._client()
            if len(raw) <= STORE_VALUE_BYTES:
                store.set(key, raw)  # type: ignore[attr-defined]
                return
            prefix = f"{key}/parts/{d.generation}-{os.urandom(6).hex()}"
            parts = range(0, len(raw), STORE_VALUE_BYTES)
            for i, at in enumerate(parts):
                store.set(f"{prefix}/{i}", raw[at : at + STORE_VALUE_BYTES])  # type: ignore[attr-defined]
            store.set(key, PARTS_MAGIC + msgpack.packb([prefix, len(parts), len(raw)]))  # type: ignore[attr-defined]
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(
                f"slot {d.slot}: cannot publish its {d.kind} descriptor of plan {d.digest} "
                f"({len(raw)} bytes): {e}"
            ) from e

    @staticmethod
    def _joined(store: object, raw: bytes) -> bytes:
        """The descriptor bytes a header of parts names (raw itself when it is no header)."""
        if not raw.startswith(PARTS_MAGIC):
            return raw
        prefix, n, total = msgpack.unpackb(raw[len(PARTS_MAGIC) :], raw=False)
        out = b"".join(store.get(f"{prefix}/{i}") for i in range(n))  # type: ignore[attr-defined]
        if len(out) != total:
            raise TransportError(f"descriptor parts under {prefix}: {len(out)} bytes of {total}")
        return out

    def fetch(self, kind: str, digest: str, slot: int, what: str) -> Descriptor:
        """The descriptor slot `slot` published for plan `digest` in this epoch, checked
        against what is expected of it; TransportError naming `what` otherwise."""
        key = descriptor_key(kind, digest, slot)
        store = self._client()
        try:
            if not store.check([key]):  # type: ignore[attr-defined]
                raise TransportError(
                    f"{what}: slot {slot} published no {kind} descriptor of plan {digest} in "
                    f"communicator epoch {self.epoch} (it has not loaded the plan)"
                )
            raw = self._joined(store, store.get(key))  # type: ignore[attr-defined]
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"{what}: cannot read slot {slot}'s descriptor: {e}") from e
        d = Descriptor.from_bytes(raw, what)
        want = (kind, self.epoch, digest, slot)
        got = (d.kind, d.epoch, d.digest, d.slot)
        if got != want:
            raise TransportError(
                f"{what}: mismatched descriptor: it is for (path, epoch, plan, slot) {got}, "
                f"expected {want}"
            )
        return d

    def close(self) -> None:
        """Drop the store client and the paths looked up (`make_path` owns them: the
        transfer process keeps them across epochs and closes them; the destinations'
        exposures are the plans')."""
        with self._lock:
            self._paths.clear()
            self._store = None
