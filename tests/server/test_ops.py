"""Ops HTTP, gRPC health/reflection, the status CLI, persistence across a restart, config."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.cli import status as status_cli
from refitd.config import add_settings_arguments, load_settings, settings_from_args
from refitd.server.controller import Controller
from refitd.server.frontend import OpsBackend, PlanSource, ServiceBackend, StatusSource
from refitd.server.http import HttpServer

from .conftest import Cluster, controller_settings, make_cluster, register

pytestmark = pytest.mark.slow


def test_http_endpoints(controller: Controller, cluster: Cluster) -> None:
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(1))
    base = f"http://{controller.http_address}"
    with httpx.Client(base_url=base, timeout=10) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"] == {
            "grpc": True,
            "database": True,
            "rendezvous": True,
            "local_agent": True,
            "restored": True,
        }
        metrics = http.get("/metrics").text
        assert f'refitd_refits_committed_total{{model="{cluster.model}"}} 1.0' in metrics
        assert f'refitd_registered_workers{{model="{cluster.model}",pool="trainer"}} 2.0' in metrics
        assert "refitd_slot_throughput_bytes_per_second" in metrics
        assert "refitd_refit_duration_seconds_bucket" in metrics
        doc = http.get("/v1/status", params={"model": cluster.model}).json()
        grpc_doc = json.loads(
            cluster.stub.GetStatus(pb.StatusRequest(model=cluster.model), timeout=5).json
        )
        assert doc["models"] == grpc_doc["models"]
        assert doc["models"][0]["committed_version"] == 1
        assert doc["refits"][0]["state"] == "committed"
        missing = http.get("/v1/status", params={"model": "nope"})
        assert missing.status_code == 404 and "'nope'" in missing.json()["detail"]
        assert http.get("/v1/status", params={"model": "x" * 200}).status_code == 422
        pools = {p["name"]: p for p in doc["models"][0]["pools"]}
        assert pools["infer"]["summary"]["versions"] == {"1": 1}
        assert pools["infer"]["summary"]["lagging"] == "" == pools["trainer"]["summary"]["dead"]
        plan = doc["models"][0]["plan"]
        assert {x["slot"] for x in plan["slots"]} == {x["slot"] for x in doc["slots"]}
        assert sum(x["send"] for x in plan["slots"]) == plan["remote_bytes"] > 0
        assert set(doc["refits"][0]["phases"]) == {
            "barrier",
            "pause",
            "transfer",
            "commit",
            "other",
        }
        brief = http.get("/v1/status", params={"model": cluster.model, "ranks": "false"}).json()
        assert all("ranks" not in p for p in brief["models"][0]["pools"])
        ex = http.get("/v1/explain", params={"model": cluster.model, "tensor": "w"}).json()
        [shard] = ex["shards"]
        assert (shard["pool"], shard["rank"]) == ("infer", 0)
        assert shard["nbytes"] >= 4 * 8 * 2  # wire bytes, segment alignment included
        assert sorted(f["source"] for f in shard["feeds"]) == ["trainer:0", "trainer:1"]
        assert "S(trainer:1)[2:4, 0:8] -> R[2:4, 0:8]" in ex["text"]
        for params, words in (
            ({"model": "nope", "tensor": "w"}, "model 'nope'"),
            ({"model": cluster.model, "tensor": "v"}, "no destination tensor 'v'"),
            ({"model": cluster.model, "tensor": "w", "pool": "p9"}, "pool 'p9'"),
            ({"model": cluster.model, "tensor": "w", "rank": 3}, "rank 3"),
        ):
            bad = http.get("/v1/explain", params=params)
            assert bad.status_code == 404 and words in bad.json()["detail"], bad.text
        page = http.get("/")
        assert page.status_code == 200 and "refitd" in page.text
        assert "http://" not in page.text and "https://" not in page.text  # no external assets
        assert http.get("/nope").status_code == 404


def test_controller_implements_what_its_front_ends_need(controller: Controller) -> None:
    """The front ends are typed against these protocols, not the Controller class: a
    started controller has every member each of them reads."""
    for protocol in (PlanSource, StatusSource, ServiceBackend, OpsBackend):
        assert isinstance(controller, protocol), protocol.__name__


def test_grpc_health_and_reflection(controller: Controller) -> None:
    with grpc.insecure_channel(controller.grpc_address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "refitd.v1.Refit", "refitd.v1.AgentControl"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        (answer,) = r.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {"refitd.v1.Refit", "refitd.v1.AgentControl"} <= names


def test_status_cli(
    controller: Controller, cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    p = argparse.ArgumentParser()
    status_cli.add_arguments(p)
    assert status_cli.run(p.parse_args(["--controller", controller.grpc_address, "--json"])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert cluster.model in [m["name"] for m in doc["models"]]
    assert status_cli.run(p.parse_args(["--controller", controller.grpc_address])) == 0
    assert f"model {cluster.model}: committed v0" in capsys.readouterr().out


def test_explain_cli(
    controller: Controller, cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    from refitd.cli import explain as explain_cli

    p = argparse.ArgumentParser()
    explain_cli.add_arguments(p)
    base = ["--controller", controller.grpc_address, cluster.model, "w"]
    assert explain_cli.run(p.parse_args([*base, "--pool", "infer", "--rank", "0"])) == 0
    out = capsys.readouterr().out
    assert "infer:0 w (canonical w, local 4x8 float32" in out
    assert "S(trainer:0)[0:2, 0:8] -> R[0:2, 0:8]" in out
    assert explain_cli.run(p.parse_args([*base, "--rank", "5"])) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_restart_keeps_versions_and_registry(tmp_path: Path) -> None:
    settings = controller_settings(tmp_path / "state")
    c = Controller(settings).start()
    try:
        with grpc.insecure_channel(c.grpc_address) as ch:
            cl = make_cluster(c, pbg.RefitStub(ch))
            for v in (1, 2):
                assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cl.refit(v))
            slots = list(cl.agent.slot_ids)
            cl.stop()
    finally:
        c.stop()
    c = Controller(settings).start()
    try:
        with grpc.insecure_channel(c.grpc_address) as ch:
            stub = pbg.RefitStub(ch)
            doc = json.loads(stub.GetStatus(pb.StatusRequest(), timeout=5).json)
            (m,) = doc["models"]
            assert m["committed_version"] == 2
            assert [v["version"] for v in m["versions"]] == [2, 1]
            assert {p["name"]: p["registered"] for p in m["pools"]} == {"trainer": 2, "infer": 1}
            assert not any(r["live"] for p in m["pools"] for r in p["ranks"])
            assert [r["version"] for r in doc["refits"][:2]] == [2, 1]
            # Not ready to refit until the agent and the inference rank it knew are back.
            ready = http_get(c, "/readyz")
            assert ready.status_code == 503
            assert ready.json()["checks"]["restored"] is False
            assert ready.json()["waiting"] == [
                *(f"restored slot {x} (cpu:{i} of host {cl.host!r})" for i, x in enumerate(slots)),
                f"restored inference rank 0 of pool 'infer' of model {cl.model!r}",
            ]
            # A restored trainer rank that asks is told to register again (NOT_FOUND).
            with pytest.raises(grpc.RpcError) as e:
                stub.Refit(pb.RefitRequest(worker_id=cl.trainers[0], version=3), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert "restored after a controller restart; register again" in e.value.details()
            # Workers and the agent re-register; slot ids and versions continue.
            from .peers import EchoAgent, Subscriber

            agent = EchoAgent(c.grpc_address, cl.host, ["cpu:0", "cpu:1", "cpu:2"]).start()
            assert agent.slot_ids == slots
            cl2 = Cluster(cl.model, cl.host, stub, agent)
            resp = register(stub, cl.model, "infer", pb.ROLE_DESTINATION, 0, 1, cl.host, "cpu:2")
            assert resp.current_version == 2
            assert http_get(c, "/readyz").json()["waiting"] == [
                f"restored inference rank 0 of pool 'infer' of model {cl.model!r}"
            ]  # registered, not subscribed yet
            cl2.subscribers.append(Subscriber(stub, resp.worker_id).start())
            assert cl2.subscribers[0].events[0].version == 2  # HELLO carries the current version
            assert http_get(c, "/readyz").status_code == 200  # trainer ranks come when they ask
            for r in range(2):
                resp = register(
                    stub, cl.model, "trainer", pb.ROLE_SOURCE, r, 2, cl.host, f"cpu:{r}"
                )
                cl2.trainers.append(resp.worker_id)
            err = cl2.refit(2, ranks=[0])[0]
            assert (
                isinstance(err, grpc.RpcError)
                and "not newer than the committed version 2" in err.details()
            )
            assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cl2.refit(3))
            cl2.stop()
    finally:
        c.stop()


def http_get(c: Controller, path: str) -> httpx.Response:
    with httpx.Client(base_url=f"http://{c.http_address}", timeout=10) as http:
        return http.get(path)


def test_config_from_flags_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "refitd.toml"
    cfg.write_text(
        'grpc_port = 6001\nhttp_port = 6002\npause_timeout_s = 7.5\ndevices = ["cpu:0", "cpu:3"]\n'
    )
    monkeypatch.setenv("REFITD_CONFIG", str(cfg))
    monkeypatch.setenv("REFITD_HTTP_PORT", "7002")
    monkeypatch.setenv("REFITD_TRANSFER_TIMEOUT_S", "9")
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    s = settings_from_args(p.parse_args(["--grpc-port", "8001", "--no-rendezvous"]))
    assert (s.grpc_port, s.http_port, s.pause_timeout_s, s.transfer_timeout_s) == (
        8001,
        7002,
        7.5,
        9.0,
    )
    assert s.local_devices() == ["cpu:0", "cpu:3"] and s.rendezvous is False
    assert s.host == "127.0.0.1" and s.commit_timeout_s == 30.0  # documented defaults
    monkeypatch.setenv("REFITD_DEVICES", "cuda:0,cuda:1")
    assert load_settings().devices == ["cuda:0", "cuda:1"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")
    cfg.write_text("grpc_prot = 1\n")
    with pytest.raises(ValueError, match="grpc_prot"):
        load_settings()


def test_http_accepts_connections_once_constructed(controller: Controller) -> None:
    """A client that connects right after start() (before uvicorn's thread runs) is queued
    and answered, not refused: the socket listens before the thread starts."""
    server = HttpServer(controller, "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass  # refused when the socket is only bound
    finally:
        server.start()
    try:
        r = httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=10)
        assert r.json() == {"status": "ok"}
    finally:
        server.stop()
