"""`refitd bench rdma`: one-sided Mooncake writes against a raw Gloo pair, same bytes, same run.

Two spawned processes: a writer and a destination. Each holds a rank of a Gloo pair (the
reference) and a Mooncake endpoint (`refitd.transport.mooncake`); the destination registers
its buffer and publishes its descriptor through a real TCPStore. For each message size the
writer moves the same bytes as messages of that size, alternating a Gloo round (sends, then
the destination's 1-byte ack) with a Mooncake round (one-sided writes; done when the engine
reports them applied at the destination), --repeat times; the destination zeroes its
buffer before each Mooncake round and checks every byte after it. Prints one JSON line:
each size's GB/s of both (medians), the ratio (median of the paired rounds) and whether
every round landed bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from refitd.bench.transfer import parse_bytes
from refitd.transport.base import ConnectInfo
from refitd.transport.gloo import GlooTransport
from refitd.transport.mooncake import MooncakeEndpoint, MooncakeOptions, WriteOp

DESC_KEY = "bench/rdma/descriptor"
CONTROL_TAG = 7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--sizes", default="64KiB,1MiB,1GiB", help="message sizes, comma separated")
    parser.add_argument(
        "--max-messages", type=int, default=4096, help="per round: bytes = min(bytes, size*this)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each, alternating")
    parser.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp")
    parser.add_argument("--devices", default="", help="RDMA devices (comma separated)")
    defaults = MooncakeOptions()
    parser.add_argument("--engines", type=int, default=defaults.engines)
    parser.add_argument("--lanes", type=int, default=defaults.lanes)
    parser.add_argument("--split", type=parse_bytes, default=defaults.split_bytes)
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--timeout", type=float, default=300.0)


def run(args: argparse.Namespace) -> int:
    options = MooncakeOptions(
        protocol=args.protocol,
        devices=tuple(d for d in args.devices.split(",") if d),
        engines=args.engines,
        lanes=args.lanes,
        split_bytes=args.split,
        window=args.window,
        batch=args.batch,
    )
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rounds = [(s, min(args.bytes, s * args.max_messages) // s) for s in sizes]
    capacity = max(s * n for s, n in rounds)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        2,
        True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    common = (store.port, options, rounds, capacity, args.repeat, args.timeout)
    procs = [
        ctx.Process(target=_destination, args=common, daemon=True),
        ctx.Process(target=_writer, args=(*common, send), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        if not recv.poll(args.timeout * (1 + len(rounds) * args.repeat)):
            raise SystemExit("bench rdma: the writer reported nothing in time")
        results = recv.recv()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if isinstance(results, str):
        raise SystemExit(f"bench rdma failed: {results}")
    out = {
        "bench": "rdma",
        "protocol": args.protocol,
        "options": asdict(replace(options, devices=list(options.devices))),
        "sizes": results,
        "verified": all(r["verified"] for r in results),
        "cpus": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0 if out["verified"] else 1


def _pattern(n: int) -> torch.Tensor:
    return torch.arange(251, dtype=torch.uint8).repeat(n // 251 + 1)[:n].clone()


def _gloo(port: int, rank: int, timeout: float) -> GlooTransport:
    gloo = GlooTransport()
    gloo.connect(ConnectInfo(1, "127.0.0.1", port, rank, 2, timeout))
    return gloo


def _destination(port, options, rounds, capacity, repeat, timeout) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )
    landing = torch.zeros(capacity, dtype=torch.uint8)
    reference = torch.zeros(capacity, dtype=torch.uint8)
    endpoint = MooncakeEndpoint(1, options)
    endpoint.register([landing], "bench")
    store.set(DESC_KEY, endpoint.descriptor())
    gloo = _gloo(port, 1, timeout)
    expected = _pattern(capacity)
    flag = torch.zeros(1, dtype=torch.uint8)
    for size, count in rounds:
        n = size * count
        for _ in range(repeat):
            c0 = time.process_time()
            works = [gloo.irecv(reference[i * size : (i + 1) * size], 0, 0) for i in range(count)]
            for w in works:
                w.wait(timeout)
            gloo_cpu = time.process_time() - c0
            gloo.isend(flag, 0, CONTROL_TAG).wait(timeout)  # received: the writer's clock stops
            landing[:n].zero_()
            gloo.isend(flag, 0, CONTROL_TAG).wait(timeout)  # zeroed: the Mooncake round starts
            c0 = time.process_time()
            gloo.irecv(flag, 0, CONTROL_TAG).wait(timeout)  # written
            mc_cpu = time.process_time() - c0
            ok = float(torch.equal(landing[:n], expected[:n]))
            report = torch.tensor([ok, gloo_cpu, mc_cpu], dtype=torch.float64)
            gloo.isend(report.view(torch.uint8), 0, CONTROL_TAG).wait(timeout)
    gloo.close()
    endpoint.close()


def _writer(port, options, rounds, capacity, repeat, timeout, out) -> None:
    try:
        out.send(_write_rounds(port, options, rounds, capacity, repeat, timeout))
    except Exception as e:
        out.send(f"{type(e).__name__}: {e}")


def _write_rounds(port, options, rounds, capacity, repeat, timeout) -> list[dict]:
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )
    source = _pattern(capacity)
    endpoint = MooncakeEndpoint(0, options)
    endpoint.register([source], "bench")
    peer = endpoint.open(store.get(DESC_KEY))
    gloo = _gloo(port, 0, timeout)
    base, remote = source.data_ptr(), peer.desc.buffers[0][0]
    results = []
    for size, count in rounds:
        ops = [WriteOp(base + i * size, remote + i * size, size) for i in range(count)]
        runs = [_round(gloo, peer, source, ops, size, timeout) for _ in range(repeat)]
        results.append(_summary(size, count, runs))
    gloo.close()
    endpoint.close()
    return results


def _round(gloo, peer, source, ops, size, timeout) -> tuple[float, ...]:
    """One Gloo round then one Mooncake round: (seconds, CPU seconds of both processes)
    of each, and whether the Mooncake round landed bit for bit."""
    flag = torch.zeros(1, dtype=torch.uint8)
    c0, t0 = time.process_time(), time.perf_counter()
    works = [gloo.isend(source[i * size : (i + 1) * size], 1, 0) for i in range(len(ops))]
    for w in works:
        w.wait(timeout)
    gloo.irecv(flag, 1, CONTROL_TAG).wait(timeout)
    gloo_s, gloo_cpu = time.perf_counter() - t0, time.process_time() - c0
    gloo.irecv(flag, 1, CONTROL_TAG).wait(timeout)  # the destination zeroed
    c0, t0 = time.process_time(), time.perf_counter()
    peer.write(ops, timeout, f"bench {size}B").wait(timeout)
    mc_s, mc_cpu = time.perf_counter() - t0, time.process_time() - c0
    gloo.isend(flag, 1, CONTROL_TAG).wait(timeout)
    report = torch.zeros(3, dtype=torch.float64)
    gloo.irecv(report.view(torch.uint8), 1, CONTROL_TAG).wait(timeout)
    ok, dst_gloo_cpu, dst_mc_cpu = report.tolist()
    return gloo_s, mc_s, gloo_cpu + dst_gloo_cpu, mc_cpu + dst_mc_cpu, ok


def _summary(size: int, count: int, runs: list[tuple[float, ...]]) -> dict:
    gloo_s, mc_s, gloo_cpu, mc_cpu, ok = zip(*runs, strict=True)
    n = size * count
    return {
        "message_bytes": size,
        "bytes": n,
        "messages": count,
        "mooncake_gbps": round(n / statistics.median(mc_s) / 1e9, 3),
        "gloo_gbps": round(n / statistics.median(gloo_s) / 1e9, 3),
        # median of the paired rounds: each pair ran back to back, under the same load
        "ratio": round(statistics.median(g / m for g, m in zip(gloo_s, mc_s, strict=True)), 3),
        # CPU seconds (writer and destination together) per GB moved: what each path costs,
        # whatever share of a loaded machine it got
        "mooncake_cpu_s_per_gb": round(statistics.median(mc_cpu) / n * 1e9, 3),
        "gloo_cpu_s_per_gb": round(statistics.median(gloo_cpu) / n * 1e9, 3),
        "verified": all(x == 1.0 for x in ok),
    }
