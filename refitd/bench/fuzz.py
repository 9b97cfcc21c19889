"""`refitd bench fuzz`: bad input against a live controller, over gRPC and HTTP.

Starts `refitd serve` (no agent, no store) as a child process, seeds it with an agent and
two workers, then sends (a) hypothesis-generated requests to every RPC (random fields,
mis-shaped boxes, huge and negative dims, unknown ids, NaN timeouts), (b) byte-mutated
serialized requests through a raw channel, (c) schemathesis cases from the ops HTTP
OpenAPI schema. After every rejected request the registry (status fingerprint) must be
unchanged and the message must name a field of the request; the daemon must stay up and
serve /healthz and a valid registration at the end; its RSS growth is reported. Prints one
JSON line. The tests in tests/fuzz drive the same harness with a few cases.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from refitd._proto import refitd_pb2 as pb

# Codes a rejected request may carry; UNKNOWN / INTERNAL mean an unhandled exception.
REJECTIONS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
WAITING = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
FUZZ_HOST = "fuzzhost"
TOKEN = "fuzz-token"
METHODS: dict[str, tuple[str, type[Message], bool]] = {
    name: (f"/{svc.full_name}/{name}", getattr(pb, m.input_type.name), m.server_streaming)
    for svc in pb.DESCRIPTOR.services_by_name.values()
    for name, m in svc.methods_by_name.items()
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-cases", type=int, default=1000, help="hypothesis gRPC requests")
    parser.add_argument("--mutations", type=int, default=1000, help="byte-mutated requests")
    parser.add_argument("--http-cases", type=int, default=200, help="schemathesis cases per op")
    parser.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------- the daemon under test
@dataclass
class FuzzTarget:
    """`refitd serve` in a child process, with a channel and an HTTP base URL."""

    data_dir: Path
    max_message_bytes: int = 1 << 20
    token: str = ""
    process: subprocess.Popen[str] | None = None
    grpc_address: str = ""
    http_base: str = ""
    metadata: tuple[tuple[str, str], ...] = ()

    def start(self, timeout_s: float = 60.0) -> FuzzTarget:
        cmd = [
            sys.executable,
            "-m",
            "refitd.cli.main",
            "serve",
            "--no-embedded-agent",
            "--no-rendezvous",
            "--grpc-port=0",
            "--http-port=0",
            f"--data-dir={self.data_dir}",
            f"--max-message-bytes={self.max_message_bytes}",
            "--barrier-timeout-s=1",
            "--log-level=critical",
        ]
        if self.token:
            cmd.append(f"--auth-token={self.token}")
            self.metadata = (("authorization", f"Bearer {self.token}"),)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REFITD_")}
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(self.process.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(timeout_s)
        m = re.search(r"gRPC (\S+), status http://(\S+)/", line[0] if line else "")
        if m is None:
            self.stop()
            raise RuntimeError(f"refitd serve did not start: {line}")
        self.grpc_address, self.http_base = m.group(1), f"http://{m.group(2)}"
        self.channel = grpc.insecure_channel(
            self.grpc_address,
            options=[("grpc.max_send_message_length", 64 << 20), ("grpc.enable_retries", 0)],
        )
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss_bytes(self) -> int:
        import psutil

        return int(psutil.Process(self.process.pid).memory_info().rss)  # type: ignore[union-attr]

    def call(self, method: str, payload: bytes, stream: bool, timeout_s: float) -> Any:
        """Send raw request bytes; returns the response bytes (first item of a stream)."""
        if stream:
            call = self.channel.unary_stream(method)(
                payload, timeout=timeout_s, metadata=self.metadata
            )
            try:
                return next(call, None)
            finally:
                call.cancel()
        return self.channel.unary_unary(method)(payload, timeout=timeout_s, metadata=self.metadata)

    def fingerprint(self) -> str:
        """The registry as GetStatus shows it, without liveness and refit progress."""
        raw = self.call(METHODS["GetStatus"][0], b"", False, 10.0)
        doc = json.loads(pb.StatusResponse.FromString(raw).json)
        models = [
            (
                m["name"],
                m["epoch"],
                m["committed_version"],
                [
                    (
                        p["name"],
                        p["role"],
                        p["size"],
                        [(r["rank"], r["worker_id"]) for r in p["ranks"]],
                    )
                    for p in m["pools"]
                ],
            )
            for m in doc["models"]
        ]
        agents = sorted((a["agent_id"], a["host"], a["pid"], a["slots"]) for a in doc["agents"])
        slots = sorted((s["slot"], s["host"], s["device"], s["agent_id"]) for s in doc["slots"])
        return json.dumps([models, agents, slots])

    def stop(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@dataclass
class Seed:
    """Known ids in the daemon so generated requests reach past the id lookups."""

    agent_id: str
    trainer_id: str
    infer_id: str
    slots: list[int]


def valid_tensor(rank: int = 0) -> pb.TensorRegistration:
    return pb.TensorRegistration(
        name="w",
        global_shape=[4, 8],
        dtype="float32",
        local_shape=[4, 8],
        boxes=[pb.Box(offset=[0, 0], shape=[4, 8], local_offset=[0, 0])],
        memory=b"handle",
    )


def valid_worker(pool: str, role: int, device: str) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(
        model="fuzzmodel",
        pool=pool,
        role=role,
        rank=0,
        pool_size=1,
        host=FUZZ_HOST,
        device=device,
        pid=1,
        tensors=[valid_tensor()],
    )


def seed(d: FuzzTarget) -> Seed:
    agent = pb.RegisterAgentResponse.FromString(
        d.call(
            METHODS["RegisterAgent"][0],
            pb.RegisterAgentRequest(
                host=FUZZ_HOST, slots=[pb.SlotInfo(device="cpu:0"), pb.SlotInfo(device="cpu:1")]
            ).SerializeToString(),
            False,
            10.0,
        )
    )
    ids = []
    for pool, role, dev in (
        ("trainer", pb.ROLE_SOURCE, "cpu:0"),
        ("infer", pb.ROLE_DESTINATION, "cpu:1"),
    ):
        raw = d.call(
            METHODS["RegisterWorker"][0],
            valid_worker(pool, role, dev).SerializeToString(),
            False,
            10.0,
        )
        ids.append(pb.RegisterWorkerResponse.FromString(raw).worker_id)
    return Seed(agent.agent_id, ids[0], ids[1], list(agent.slot_ids))


# ---------------------------------------------------------------- outcomes
def field_names(desc: Descriptor, seen: set[str] | None = None) -> set[str]:
    """Every field name of a message type and of the message types it nests."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    if desc.full_name in seen:
        return names
    seen.add(desc.full_name)
    for f in desc.fields:
        names.add(f.name)
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            names |= field_names(f.message_type, seen)
    return names


def names_a_field(message: str, request_type: type[Message]) -> bool:
    """A rejection is clear when it names a field of the request, the undecodable type, or
    the worker, agent or tensor it is about."""
    if "request of /" in message:
        return True
    words = set(re.findall(r"[A-Za-z_]+", message))
    return bool(words & (field_names(request_type.DESCRIPTOR) | {"tensor", "worker", "agent"}))


@dataclass
class FuzzStats:
    """What the fuzzing saw; `problems` lists every crash, state change or unclear message."""

    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def record(self, d: FuzzTarget, rpc: str, payload: bytes, timeout_s: float = 1.0) -> None:
        path, req_type, stream = METHODS[rpc]
        before = d.fingerprint()
        self.sent += 1
        try:
            d.call(path, payload, stream, timeout_s)
            self.codes["OK"] += 1
            return
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        self.codes[code.name] += 1
        if not d.alive:
            self.problems.append(f"{rpc}: daemon died ({code.name}: {details})")
            raise RuntimeError(self.problems[-1])
        if code in WAITING:
            return
        if code not in REJECTIONS:
            self.problems.append(f"{rpc}: {code.name}: {details[:300]} for {payload[:200]!r}")
            return
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED and not names_a_field(details, req_type):
            self.problems.append(f"{rpc}: unclear rejection {code.name}: {details[:300]}")
        after = d.fingerprint()
        if after != before:
            self.problems.append(
                f"{rpc}: rejected ({code.name}: {details[:200]}) but state changed"
            )

    def summary(self) -> dict[str, Any]:
        return {"sent": self.sent, "codes": dict(self.codes), "problems": len(self.problems)}


# ---------------------------------------------------------------- generated requests
EDGE_INTS = [0, 1, 2, 3, 4, 8, -1, -2, 2**31 - 1, -(2**31), 2**40, 2**62, 2**63 - 1, -(2**63)]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e300, 1e-300]


def _strategies(s: Seed) -> dict[str, Any]:
    from hypothesis import strategies as st

    ids = st.sampled_from([s.agent_id, s.trainer_id, s.infer_id, "", "nope", "x" * 100, "id\x00"])
    text = st.one_of(
        st.sampled_from(
            [
                "",
                "w",
                "fuzzmodel",
                "trainer",
                "infer",
                FUZZ_HOST,
                "cpu:0",
                "cuda:1",
                "cpu:-1",
                "float32",
                "bfloat16",
                "plain",
                "mxfp8",
                "nonsense",
                "a b",
                "x" * 5000,
                "\x01",
                "w\x00",
                "é",
                "../../etc/passwd",
            ]
        ),
        st.text(max_size=20),
    )
    small = st.one_of(st.integers(-2, 9), st.sampled_from(EDGE_INTS))
    return {
        "ids": ids,
        "text": text,
        "int": small,
        "float": st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True)),
        "bytes": st.one_of(st.just(b""), st.binary(max_size=16), st.just(b"h" * 70000)),
        "bool": st.booleans(),
    }


def _int32(v: int) -> bool:
    return -(2**31) <= v < 2**31


def message_strategy(desc: Descriptor, s: Seed, depth: int = 0) -> Any:
    """A strategy of messages of type `desc` with every field drawn from edge-heavy pools."""
    from hypothesis import strategies as st

    pools = _strategies(s)
    cls = getattr(pb, desc.name)

    def value(f: FieldDescriptor) -> Any:
        if f.message_type is not None:
            if f.message_type.GetOptions().map_entry:
                k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                return st.dictionaries(scalar(k), scalar(v), max_size=3)
            if depth >= 2:
                return st.just([]) if f.is_repeated else st.none()
            inner = message_strategy(f.message_type, s, depth + 1)
            if f.is_repeated:
                return st.lists(inner, max_size=3)
            return st.one_of(st.none(), inner)
        if f.is_repeated:
            return st.lists(scalar(f), max_size=4 if f.name != "global_shape" else 12)
        return scalar(f)

    def scalar(f: FieldDescriptor) -> Any:
        if f.name in ("worker_id", "agent_id"):
            return pools["ids"]
        if f.name in ("slot",):
            return st.one_of(st.sampled_from(s.slots), pools["int"].filter(_int32))
        t = f.type
        if t == FieldDescriptor.TYPE_STRING:
            return pools["text"]
        if t == FieldDescriptor.TYPE_BYTES:
            return pools["bytes"]
        if t == FieldDescriptor.TYPE_BOOL:
            return pools["bool"]
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return pools["float"]
        if t == FieldDescriptor.TYPE_ENUM:
            return st.one_of(
                st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-3, 99)
            )
        if t in (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_ENUM,
        ):
            return pools["int"].filter(_int32)
        if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            return pools["int"].filter(lambda v: 0 <= v < 2**64)
        if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            return pools["int"].filter(lambda v: 0 <= v < 2**32)
        return pools["int"]

    fields = {f.name: value(f) for f in desc.fields}

    @st.composite
    def build(draw: Any) -> Message:
        chosen = draw(st.sets(st.sampled_from(sorted(fields)), max_size=len(fields)))
        kw = {name: draw(fields[name]) for name in chosen}
        kw = {k: v for k, v in kw.items() if v is not None}
        return cls(**kw)

    return build()


def near_valid_registration(s: Seed) -> Any:
    """RegisterWorker requests with a valid header and generated (mostly small) tensors."""
    from hypothesis import strategies as st

    tensor = message_strategy(pb.TensorRegistration.DESCRIPTOR, s)

    @st.composite
    def build(draw: Any) -> pb.RegisterWorkerRequest:
        pool = draw(st.sampled_from(["trainer", "infer", "newpool"]))
        req = valid_worker(
            pool,
            pb.ROLE_SOURCE if pool == "trainer" else pb.ROLE_DESTINATION,
            "cpu:0" if pool == "trainer" else "cpu:1",
        )
        req.pool_size = draw(st.sampled_from([1, 1, 2, 0, -1, 2**31 - 1]))
        req.rank = draw(st.sampled_from([0, 0, 1, -1]))
        del req.tensors[:]
        req.tensors.extend(draw(st.lists(tensor, min_size=1, max_size=3)))
        return req

    return build()


def grpc_requests(s: Seed) -> Any:
    """(rpc name, request) pairs over every RPC, and near-valid registrations."""
    from hypothesis import strategies as st

    per_rpc = [
        st.tuples(st.just(name), message_strategy(req.DESCRIPTOR, s))
        for name, (_, req, _) in METHODS.items()
    ]
    near = st.tuples(st.just("RegisterWorker"), near_valid_registration(s))
    return st.one_of(*per_rpc, near, near)


def fuzz_grpc(d: FuzzTarget, s: Seed, stats: FuzzStats, cases: int, seed_value: int = 0) -> None:
    """`cases` hypothesis-generated requests, each checked by FuzzStats.record."""
    from hypothesis import HealthCheck, given, seed, settings

    @seed(seed_value)
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(grpc_requests(s))
    def one(item: tuple[str, Message]) -> None:
        rpc, request = item
        stats.record(d, rpc, request.SerializeToString())

    one()


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four byte-level edits: flip, set, insert, delete, truncate, duplicate."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[i % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i % len(b)] = rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and b:
            del b[i : i + rng.randint(1, 4)]
        elif op == 4:
            del b[i:]
        else:
            b[i:i] = b[: rng.randint(1, 16)]
    return bytes(b)


def valid_requests(s: Seed) -> list[tuple[str, Message]]:
    """One well-formed request per RPC, the raw material of byte mutation."""
    return [
        ("RegisterWorker", valid_worker("trainer", pb.ROLE_SOURCE, "cpu:0")),
        ("UnregisterWorker", pb.UnregisterWorkerRequest(worker_id=s.infer_id)),
        ("Heartbeat", pb.HeartbeatRequest(worker_id=s.trainer_id)),
        ("Refit", pb.RefitRequest(worker_id=s.trainer_id, version=5, wait=pb.WAIT_ACCEPTED)),
        ("Subscribe", pb.SubscribeRequest(worker_id=s.infer_id)),
        ("Ack", pb.AckRequest(worker_id=s.infer_id, event_id=3, ok=True, moved_tensors=["w"])),
        ("GetStatus", pb.StatusRequest(model="fuzzmodel")),
        ("Explain", pb.ExplainRequest(model="fuzzmodel", tensor="w", pool="infer", rank=0)),
        (
            "RegisterAgent",
            pb.RegisterAgentRequest(host=FUZZ_HOST, slots=[pb.SlotInfo(device="cpu:0")]),
        ),
        ("Commands", pb.AgentStreamRequest(agent_id=s.agent_id)),
        (
            "Report",
            pb.AgentReport(
                agent_id=s.agent_id,
                slot=s.slots[0],
                command_id=1,
                kind=pb.REPORT_KIND_DONE,
                seconds=0.5,
                message="ok",
                more=[pb.AgentReport(slot=s.slots[-1], kind=2)],
            ),
        ),
        ("AgentHeartbeat", pb.AgentHeartbeatRequest(agent_id=s.agent_id)),
    ]


def fuzz_bytes(d: FuzzTarget, s: Seed, stats: FuzzStats, cases: int, seed_value: int = 0) -> None:
    """`cases` byte-mutated serialized requests sent raw (no client-side serialization)."""
    rng = random.Random(seed_value)
    base = [(rpc, req.SerializeToString()) for rpc, req in valid_requests(s)]
    for _ in range(cases):
        rpc, data = rng.choice(base)
        stats.record(d, rpc, mutate(data, rng))


# ---------------------------------------------------------------- HTTP
def fuzz_http(base_url: str, cases: int, seed_value: int = 0) -> dict[str, Any]:
    """schemathesis cases for every operation of the ops API: no 5xx, 4xx bodies are JSON."""
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: Counter[int] = Counter()
    problems: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()

        @seed(seed_value)
        @settings(
            max_examples=cases,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def one(case: Any) -> None:
            r = case.call(base_url=base_url, timeout=10)
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                problems.append(f"{case.method} {case.path}: {r.status_code} {r.text[:200]}")
            elif 400 <= r.status_code < 500:
                try:
                    body = r.json()
                except ValueError:
                    problems.append(f"{case.method} {case.path}: {r.status_code} not JSON")
                    return
                if "detail" not in body:
                    problems.append(f"{case.method} {case.path}: {r.status_code} without detail")

        one()
    return {"sent": sum(statuses.values()), "statuses": dict(statuses), "problems": problems}


def healthy_after(d: FuzzTarget) -> bool:
    """The daemon still serves /healthz and accepts a valid registration."""
    import httpx

    ok = httpx.get(f"{d.http_base}/healthz", timeout=5).json() == {"status": "ok"}
    raw = d.call(
        METHODS["RegisterWorker"][0],
        valid_worker("after", pb.ROLE_DESTINATION, "cpu:1").SerializeToString(),
        False,
        10.0,
    )
    return ok and bool(pb.RegisterWorkerResponse.FromString(raw).worker_id) and d.alive


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="refitd-fuzz-") as tmp:
        d = FuzzTarget(Path(tmp)).start()
        try:
            s = seed(d)
            stats = FuzzStats()
            rss0 = d.rss_bytes()
            start = time.perf_counter()
            fuzz_grpc(d, s, stats, args.grpc_cases, args.seed)
            fuzz_bytes(d, s, stats, args.mutations, args.seed)
            grpc_s = time.perf_counter() - start
            http = fuzz_http(d.http_base, args.http_cases, args.seed)
            rss1 = d.rss_bytes()
            alive = healthy_after(d)
        finally:
            d.stop()
    for p in stats.problems + http["problems"]:
        print(p, file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "fuzz",
                "grpc": stats.summary(),
                "grpc_seconds": round(grpc_s, 1),
                "http": {k: v for k, v in http.items() if k != "problems"},
                "http_problems": len(http["problems"]),
                "daemon_alive_and_serving": alive,
                "rss_start_mib": round(rss0 / 2**20, 1),
                "rss_end_mib": round(rss1 / 2**20, 1),
                "rss_growth_ratio": round(rss1 / rss0, 3),
            }
        )
    )
    return 0 if alive and not stats.problems and not http["problems"] else 1
