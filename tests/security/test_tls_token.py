"""TLS, mutual TLS and the bearer token, over real gRPC and HTTPS on 127.0.0.1."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.config import load_settings
from refitd.credentials import store_secret
from refitd.rpc.connection import ControllerConnection, RefitError
from refitd.security import TOKEN_COOKIE, ClientSecurity
from refitd.server.controller import Controller

from .certs import Pki

TOKEN = "s3cret-token-for-tests"
AGENT = pb.RegisterAgentRequest(host="h1", slots=[pb.SlotInfo(device="cpu:0")], pid=1)


def tls_client(
    pki: Pki, ca: Path | None = None, cert: bool = False, token: str = ""
) -> ClientSecurity:
    return ClientSecurity(
        tls=True,
        ca=(ca or pki.ca).read_bytes(),
        cert=pki.client_cert.read_bytes() if cert else b"",
        key=pki.client_key.read_bytes() if cert else b"",
        token=token,
    )


def status_ok(conn: ControllerConnection) -> bool:
    resp = conn.call(conn.refit.GetStatus, pb.StatusRequest(), "status", timeout_s=5)
    return "agents" in json.loads(resp.json)


def _ssl_context(pki: Pki, cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return ctx


def test_tls_serves_and_refuses_plaintext(
    pki: Pki, start_controller: Callable[..., Controller]
) -> None:
    c = start_controller(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    conn = ControllerConnection(c.grpc_address, 5, tls_client(pki))
    assert status_ok(conn)
    resp = conn.call(conn.agents.RegisterAgent, AGENT, "register agent")
    assert resp.slot_ids
    conn.close()

    plain = ControllerConnection(c.grpc_address, 2, ClientSecurity())
    with pytest.raises(RefitError) as e:
        status_ok(plain)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    plain.close()

    stranger = ControllerConnection(c.grpc_address, 2, tls_client(pki, ca=pki.other_ca))
    with pytest.raises(RefitError) as e:
        status_ok(stranger)  # the server's certificate is not signed by the CA we trust
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    stranger.close()

    port = c.http.port  # type: ignore[union-attr]
    r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=_ssl_context(pki, False), timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)


def test_mutual_tls_requires_a_client_certificate(
    pki: Pki, start_controller: Callable[..., Controller]
) -> None:
    c = start_controller(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_ca=str(pki.ca),
        require_client_cert=True,
    )
    with_cert = ControllerConnection(c.grpc_address, 5, tls_client(pki, cert=True))
    assert status_ok(with_cert)
    with_cert.close()
    no_cert = ControllerConnection(c.grpc_address, 2, tls_client(pki, cert=False))
    with pytest.raises(RefitError) as e:
        status_ok(no_cert)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    no_cert.close()

    url = f"https://127.0.0.1:{c.http.port}/healthz"  # type: ignore[union-attr]
    assert httpx.get(url, verify=_ssl_context(pki, True), timeout=5).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, verify=_ssl_context(pki, False), timeout=5)


def test_embedded_agent_settings_dial_tls_with_token(
    pki: Pki, start_controller: Callable[..., Controller], tmp_path: Path
) -> None:
    """The settings `refitd serve` hands its own agent: server cert as client cert, CA, token."""
    kw = dict(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_ca=str(pki.ca),
        require_client_cert=True,
        auth_token=TOKEN,
    )
    c = start_controller(**kw)
    s = load_settings(None, data_dir=tmp_path, **kw)
    conn = ControllerConnection(c.grpc_address, 5, ClientSecurity.from_settings(s))
    resp = conn.call(conn.agents.RegisterAgent, AGENT, "register agent")
    assert resp.agent_id in c.registry.agents
    conn.close()


def test_token_required_for_mutating_rpcs(start_controller: Callable[..., Controller]) -> None:
    c = start_controller(auth_token=TOKEN)
    ch = grpc.insecure_channel(c.grpc_address)
    refit, agents = pbg.RefitStub(ch), pbg.AgentControlStub(ch)
    calls = [
        (refit.RegisterWorker, pb.RegisterWorkerRequest(model="m", pool="p")),
        (refit.UnregisterWorker, pb.UnregisterWorkerRequest(worker_id="w")),
        (refit.Heartbeat, pb.HeartbeatRequest(worker_id="w")),
        (refit.Refit, pb.RefitRequest(worker_id="w", version=1)),
        (refit.Ack, pb.AckRequest(worker_id="w", event_id=1)),
        (agents.RegisterAgent, AGENT),
        (agents.Report, pb.AgentReport(agent_id="a")),
        (agents.AgentHeartbeat, pb.AgentHeartbeatRequest(agent_id="a")),
    ]
    for metadata, why in (((), "none was sent"), ((("authorization", "Bearer nope"),), "not the")):
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as e:
                method(request, timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert why in e.value.details() and "auth_token" in e.value.details()
        for stream in (
            refit.Subscribe(pb.SubscribeRequest(worker_id="w"), timeout=5, metadata=metadata),
            agents.Commands(pb.AgentStreamRequest(agent_id="a"), timeout=5, metadata=metadata),
        ):
            with pytest.raises(grpc.RpcError) as e:
                next(stream)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not c.registry.agents and not c.registry.models  # nothing got through

    # Read-only calls stay open.
    assert json.loads(refit.GetStatus(pb.StatusRequest(), timeout=5).json)["agents"] == []
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    ch.close()

    conn = ControllerConnection(c.grpc_address, 5, ClientSecurity(token=TOKEN))
    resp = conn.call(conn.agents.RegisterAgent, AGENT, "register agent")
    assert resp.agent_id in c.registry.agents
    conn.close()


def test_token_file_and_store_secret(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    s = load_settings(None, data_dir=tmp_path, auth_token_file=str(f))
    assert ClientSecurity.from_settings(s).token == TOKEN
    # The rendezvous key prefix agents get is derived from the token, never the token itself.
    assert s.store_token == store_secret(TOKEN) and TOKEN not in s.store_token
    assert len(s.store_token) == 32 and store_secret("other") != s.store_token
    assert load_settings(None, data_dir=tmp_path).store_token == ""
    with pytest.raises(ValueError, match="auth_token_file"):
        load_settings(None, data_dir=tmp_path, auth_token_file=str(tmp_path / "missing"))


def test_http_token(start_controller: Callable[..., Controller]) -> None:
    c = start_controller(auth_token=TOKEN)
    base = f"http://127.0.0.1:{c.http.port}"  # type: ignore[union-attr]
    with httpx.Client(base_url=base, timeout=5) as h:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert h.get(path).status_code == 200, path
        for path in ("/v1/status", "/"):
            r = h.get(path)
            assert r.status_code == 401 and "auth_token" in r.json()["detail"], path
            r = h.get(path, headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401 and "not the" in r.json()["detail"]
        assert (
            h.get("/v1/status", headers={"authorization": f"Bearer {TOKEN}"}).json()["models"] == []
        )
        page = h.get("/", params={"token": TOKEN})
        assert page.status_code == 200 and page.cookies.get(TOKEN_COOKIE) == TOKEN
    with httpx.Client(base_url=base, timeout=5, cookies={TOKEN_COOKIE: TOKEN}) as h:
        assert h.get("/v1/status").status_code == 200
