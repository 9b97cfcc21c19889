"""The Mooncake transport: real engines in two processes over TCP on loopback, descriptors
through a real TCPStore, every landed byte compared with what the writer sent. Also the
refusals: writes outside the registrations, stale and altered descriptors, a peer that
unregistered, a stalled peer (write timeout), a peer killed mid-write, an absent fabric."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from refitd.cli.main import build_parser
from refitd.config import load_settings, settings_from_args
from refitd.transport.errors import TransportError
from refitd.transport.mooncake import (
    MooncakeEndpoint,
    MooncakeOptions,
    SegmentDescriptor,
    WriteOp,
)
from refitd.transport.mooncake_env import mooncake_unavailable_reason, rdma_devices_present

REASON = mooncake_unavailable_reason()
needs_mooncake = pytest.mark.skipif(REASON is not None, reason=f"mooncake transport: {REASON}")

MiB = 1 << 20
DEST_BYTES = 48 * MiB
SEED = 11
TIMEOUT = 30.0


def _source_bytes(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _destination(port: int, conn) -> None:
    """A destination slot: registers on command, publishes its descriptor in the store,
    and checks landed bytes against the writer's pattern, computed here independently."""
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT)
    )
    buf = torch.zeros(DEST_BYTES, dtype=torch.uint8)
    endpoint = MooncakeEndpoint(1)
    conn.send(endpoint.sessions)
    while True:
        cmd, arg = conn.recv()
        if cmd == "register":  # (token, nbytes): a program load
            token, nbytes = arg
            endpoint.register([buf[:nbytes]], token)
            store.set(f"desc/{token}", endpoint.descriptor())
            conn.send(buf.data_ptr())
        elif cmd == "unregister":
            endpoint.unregister()
            conn.send("ok")
        elif cmd == "verify":  # [(source offset, destination offset, nbytes)]
            want = torch.zeros(DEST_BYTES, dtype=torch.uint8)
            src = _source_bytes(DEST_BYTES)
            for s, d, n in arg:
                want[d : d + n] = src[s : s + n]
            diff = (buf != want).nonzero()
            conn.send(-1 if diff.numel() == 0 else int(diff[0]))
        elif cmd == "exit":
            endpoint.close()
            return


class Dest:
    def __init__(self, store_port: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_destination, args=(store_port, child), daemon=True)
        self.proc.start()
        self.sessions = self.ask(None)

    def ask(self, cmd: tuple | None, timeout: float = TIMEOUT):
        if cmd is not None:
            self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"destination did not answer {cmd}")
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )


@pytest.fixture
def dest(store):
    d = Dest(store.port)
    yield d
    d.close()


@pytest.fixture
def writer():
    endpoint = MooncakeEndpoint(0)
    source = _source_bytes(DEST_BYTES)
    endpoint.register([source], "writer")
    yield endpoint, source
    endpoint.close()


@pytest.mark.slow
@needs_mooncake
def test_regions_land_bit_for_bit_and_bad_writes_are_refused(store, dest, writer) -> None:
    endpoint, source = writer
    base = dest.ask(("register", ("load-1", DEST_BYTES)))
    peer = endpoint.open(store.get("desc/load-1"), token="load-1")
    assert (peer.slot, peer.desc.sessions) == (1, dest.sessions)
    s0 = source.data_ptr()
    # (source offset, destination offset, nbytes): 64 KiB, 1 MiB and large regions, odd
    # sizes, scattered and out of order, with untouched gaps between them
    regions = [(3 * MiB, 0, 64 << 10), (7, 100_003, 1), (5 * MiB + 1, 200_000, 4097)]
    regions += [(i * MiB, 2 * MiB + i * (MiB + 4096), MiB) for i in range(8)]
    regions += [(0, 12 * MiB, 20 * MiB + 13), (21 * MiB, 40 * MiB, 64 << 10)]
    ops = [WriteOp(s0 + s, base + d, n) for s, d, n in reversed(regions)]
    peer.write(ops, TIMEOUT, message="m1").wait(TIMEOUT)
    assert dest.ask(("verify", regions)) == -1

    with pytest.raises(TransportError, match=r"message m2 to slot 1 .*outside the peer's"):
        peer.write([WriteOp(s0, base + DEST_BYTES - 10, 11)], TIMEOUT, message="m2")
    with pytest.raises(TransportError, match=r"slot 0: source .* outside this slot's registered"):
        peer.write([WriteOp(s0 + DEST_BYTES - 10, base, 11)], TIMEOUT, message="m3")
    with pytest.raises(TransportError, match="expected 'load-2'"):
        endpoint.open(store.get("desc/load-1"), token="load-2")

    # a new program load registers a smaller buffer: the old descriptor is stale, and the
    # peer's engine itself refuses bytes that are no longer registered
    dest.ask(("register", ("load-2", 16 * MiB)))
    with pytest.raises(TransportError, match=r"stale segment descriptor of slot 1"):
        endpoint.open(store.get("desc/load-1"))
    late = peer.write([WriteOp(s0, base + 20 * MiB, MiB)], TIMEOUT, message="m4")
    with pytest.raises(TransportError, match=r"message m4 to slot 1 .*failed the request itself"):
        late.wait(TIMEOUT)
    fresh = endpoint.open(store.get("desc/load-2"), token="load-2")
    with pytest.raises(TransportError, match="outside the peer's registered buffers"):
        fresh.write([WriteOp(s0, base + 20 * MiB, MiB)], TIMEOUT, message="m5")
    fresh.write([WriteOp(s0, base + MiB, MiB)], TIMEOUT, message="m6").wait(TIMEOUT)
    assert dest.ask(("verify", [*regions, (0, MiB, MiB)])) == -1  # gaps untouched

    # an altered descriptor fails its digest before anything is sent
    altered = (
        SegmentDescriptor.decode(store.get("desc/load-2"))
        .encode()
        .replace(str(base).encode(), str(base + 4096).encode(), 1)
    )
    with pytest.raises(TransportError, match="does not match its digest"):
        endpoint.open(altered)


@pytest.mark.slow
@needs_mooncake
def test_peer_whose_memory_is_not_registered(store, dest, writer) -> None:
    endpoint, source = writer
    base = dest.ask(("register", ("load-1", MiB)))
    peer = endpoint.open(store.get("desc/load-1"))
    dest.ask(("unregister", None))
    with pytest.raises(TransportError, match="registered no memory"):
        endpoint.open(store.get("desc/load-1"))
    work = peer.write([WriteOp(source.data_ptr(), base, 4096)], TIMEOUT, message="m1")
    with pytest.raises(
        TransportError,
        match=r"the engine failed the request itself: the peer.s memory is no longer registered",
    ):
        work.wait(TIMEOUT)
    with pytest.raises(TransportError, match="no memory registered"):
        MooncakeEndpoint(2).descriptor()


@pytest.mark.slow
@needs_mooncake
def test_stalled_peer_times_out_and_killed_peer_fails_fast(store, dest, writer) -> None:
    endpoint, source = writer
    base = dest.ask(("register", ("load-1", DEST_BYTES)))
    peer = endpoint.open(store.get("desc/load-1"))
    ops = [WriteOp(source.data_ptr(), base, DEST_BYTES)]
    os.kill(dest.proc.pid, signal.SIGSTOP)  # alive, but its engine no longer reads
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"m1 to slot 1 .*timed out after 1.0s"):
        peer.write(ops, TIMEOUT, message="m1").wait(1.0)
    assert time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"slot 1 .* does not answer \(stalled\?\) in 1s"):
        endpoint.open(store.get("desc/load-1"), timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0
    work = peer.write(ops, TIMEOUT, message="m2")  # stalls on full socket buffers
    os.kill(dest.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"m2 to slot 1 .*peer gone"):
        work.wait(TIMEOUT)
    assert time.monotonic() - t0 < 10.0
    with pytest.raises(TransportError, match=r"m3 to slot 1 .*peer gone"):
        peer.write(ops, TIMEOUT, message="m3").wait(TIMEOUT)
    with pytest.raises(TransportError, match=r"slot 1 .* is gone"):
        endpoint.open(store.get("desc/load-1"))


@pytest.mark.slow
@needs_mooncake
def test_requests_queued_behind_a_slow_link_wait_for_it(store, dest, monkeypatch) -> None:
    """More requests than the engine queues per peer, to a peer that stops reading for
    longer than the engine's admission wait (a link shaped slower than the writes): the
    requests wait their turn and land, none fails while the writer's own timeout lasts."""
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "4")
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "1")
    endpoint = MooncakeEndpoint(0, MooncakeOptions(engines=1, lanes=1))
    try:
        source = _source_bytes(DEST_BYTES)
        endpoint.register([source], "writer")
        base = dest.ask(("register", ("load-1", DEST_BYTES)))
        peer = endpoint.open(store.get("desc/load-1"))
        step = 256 << 10
        regions = [(off, off, step) for off in range(0, DEST_BYTES, step)]
        os.kill(dest.proc.pid, signal.SIGSTOP)  # the link stops draining
        work = peer.write(
            [WriteOp(source.data_ptr() + s, base + d, n) for s, d, n in regions], TIMEOUT, "m1"
        )
        time.sleep(1.6)  # the stall under test: longer than the engine's 1 s admission wait
        os.kill(dest.proc.pid, signal.SIGCONT)
        work.wait(TIMEOUT)
        assert dest.ask(("verify", regions)) == -1
    finally:
        endpoint.close()


@needs_mooncake
def test_absent_fabric_and_unknown_protocol_are_refused() -> None:
    with pytest.raises(TransportError, match="must be tcp or rdma"):
        MooncakeEndpoint(0, MooncakeOptions(protocol="ib"))
    present = rdma_devices_present()
    if present:
        with pytest.raises(TransportError, match=r"rdma_devices nosuch0 not found"):
            MooncakeEndpoint(0, MooncakeOptions(protocol="rdma", devices=("nosuch0",)))
    else:
        with pytest.raises(TransportError, match=r"no RDMA device .*use rdma_protocol=tcp"):
            MooncakeEndpoint(0, MooncakeOptions(protocol="rdma"))


def test_rdma_settings_reach_from_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REFITD_CONFIG", raising=False)
    monkeypatch.delenv("REFITD_RDMA_PROTOCOL", raising=False)
    monkeypatch.setenv("REFITD_RDMA_DEVICES", "mlx5_0, mlx5_1")
    toml = tmp_path / "refitd.toml"
    toml.write_text('rdma_protocol = "rdma"\n')
    settings = load_settings(toml)
    assert (settings.rdma_protocol, settings.rdma_devices) == ("rdma", ["mlx5_0", "mlx5_1"])
    argv = ["agent", "--rdma-protocol", "tcp", "--rdma-devices", "mlx5_2"]
    settings = settings_from_args(build_parser(argv).parse_args(argv))
    assert (settings.rdma_protocol, settings.rdma_devices) == ("tcp", ["mlx5_2"])
    with pytest.raises(ValueError, match="rdma_protocol must be tcp or rdma"):
        load_settings(None, rdma_protocol="ib")
