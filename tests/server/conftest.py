"""A real controller on 127.0.0.1 (ephemeral ports, SQLite under tmp_path) and its peers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.config import Settings, load_settings
from refitd.server.controller import Controller

from .peers import EchoAgent, Subscriber, row_shard

_names = itertools.count()


def controller_settings(data_dir: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        grpc_port=0,
        http_port=0,
        data_dir=data_dir,
        barrier_timeout_s=3.0,
        pause_timeout_s=3.0,
        transfer_timeout_s=3.0,
        commit_timeout_s=3.0,
        connect_timeout_s=5.0,
        load_timeout_s=5.0,
        grpc_workers=64,
        # these tests look at the plan state between their own steps: plans built ahead by
        # the lease watcher's chore would race them (tests/server/test_plan_ahead.py)
        plan_ahead=False,
    )
    base.update(kw)
    return load_settings(None, **base)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    c = Controller(controller_settings(tmp_path_factory.mktemp("state"))).start()
    yield c
    c.stop()


@pytest.fixture
def stub(controller: Controller) -> Iterator[pbg.RefitStub]:
    ch = grpc.insecure_channel(controller.grpc_address)
    yield pbg.RefitStub(ch)
    ch.close()


@dataclass
class Cluster:
    """One model: trainer pool of 2 ranks (cpu:0, cpu:1), inference pool of 1 (cpu:2)."""

    model: str
    host: str
    stub: pbg.RefitStub
    agent: EchoAgent
    trainers: list[str] = field(default_factory=list)
    inference: list[str] = field(default_factory=list)
    subscribers: list[Subscriber] = field(default_factory=list)

    def refit(
        self, version: int, wait: int = pb.WAIT_COMMITTED, ranks: list[int] | None = None
    ) -> list[pb.RefitResponse | grpc.RpcError]:
        ids = [self.trainers[r] for r in (ranks if ranks is not None else range(2))]

        def call(wid: str) -> pb.RefitResponse | grpc.RpcError:
            try:
                return self.stub.Refit(
                    pb.RefitRequest(worker_id=wid, version=version, wait=wait), timeout=30
                )
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(len(ids)) as ex:
            return list(ex.map(call, ids))

    def stop(self) -> None:
        for s in self.subscribers:
            s.stop()
        self.agent.stop()


def register(
    stub: pbg.RefitStub,
    model: str,
    pool: str,
    role: int,
    rank: int,
    size: int,
    host: str,
    device: str,
) -> pb.RegisterWorkerResponse:
    return stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            model=model,
            pool=pool,
            role=role,
            rank=rank,
            pool_size=size,
            host=host,
            device=device,
            pid=100 + rank,
            tensors=[row_shard("w", 4, 8, rank, size)],
        ),
        timeout=10,
    )


def make_cluster(
    c: Controller, stub: pbg.RefitStub, on_stream: bool = False, **agent_kw: object
) -> Cluster:
    """The Cluster of the class docstring; `on_stream`: its inference rank acks on its
    Events stream (else with Ack calls, as clients without Events do)."""
    n = next(_names)
    host = f"host{n}"
    agent = EchoAgent(c.grpc_address, host, ["cpu:0", "cpu:1", "cpu:2"], **agent_kw).start()  # type: ignore[arg-type]
    cl = Cluster(f"m{n}", host, stub, agent)
    for r in range(2):
        resp = register(stub, cl.model, "trainer", pb.ROLE_SOURCE, r, 2, host, f"cpu:{r}")
        cl.trainers.append(resp.worker_id)
    resp = register(stub, cl.model, "infer", pb.ROLE_DESTINATION, 0, 1, host, "cpu:2")
    cl.inference.append(resp.worker_id)
    cl.subscribers.append(Subscriber(stub, resp.worker_id, on_stream=on_stream).start())
    return cl


@pytest.fixture
def cluster(controller: Controller, stub: pbg.RefitStub) -> Iterator[Cluster]:
    cl = make_cluster(controller, stub)
    yield cl
    cl.stop()
