"""Ops HTTP (FastAPI): health, readiness, Prometheus metrics, the status JSON and page.

Runs on uvicorn in a thread of the controller process, over TLS when the controller has a
certificate. Errors are 4xx with a JSON body. With a token configured, /v1/status and the
page need it (docs/security.md); /healthz, /readyz and /metrics stay open.
"""

from __future__ import annotations

import socket
import threading
from importlib import resources
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from refitd import __version__
from refitd.security import TOKEN_COOKIE
from refitd.server.auth import http_token_dependency
from refitd.server.errors import ControlError, ErrorKind
from refitd.server.explain import explain_document
from refitd.server.frontend import OpsBackend
from refitd.server.status import status_document

HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.PRECONDITION: 409,
    ErrorKind.DEADLINE: 504,
    ErrorKind.UNAVAILABLE: 503,
}


def build_app(c: OpsBackend) -> FastAPI:
    """The ops app of one controller."""
    app = FastAPI(title="refitd", version=__version__, docs_url=None, redoc_url=None)
    page = resources.files("refitd.server").joinpath("static/status.html").read_text()
    guarded = [Depends(http_token_dependency(c.security.token))]

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Always ok while the process lives."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Ready to refit: gRPC serves, the database answers, the rendezvous store runs,
        the embedded agent is connected and the restored members are back (or gone);
        `waiting` names what it still waits for (refitd.server.readiness)."""
        checks = c.readiness()
        ok = all(checks.values())
        body = {"ready": ok, "checks": checks, "waiting": [] if ok else c.ready.waiting()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        c.refresh_gauges()
        return Response(c.metrics.render(), media_type=c.metrics.content_type)

    @app.get("/v1/status", dependencies=guarded)
    def status(
        model: str = Query("", max_length=128, description="only this model"),
        ranks: bool = Query(True, description="include the per-rank tables"),
    ) -> dict[str, Any]:
        if model and not c.registry.has_model(model):
            raise HTTPException(404, f"model {model!r} is not registered")
        return status_document(c, model, with_ranks=ranks)

    @app.get("/v1/explain", dependencies=guarded)
    def explain(
        model: str = Query(..., max_length=128, description="the model"),
        tensor: str = Query(..., max_length=1024, description="tensor or canonical name"),
        pool: str = Query("", max_length=128, description="only this destination pool"),
        rank: int | None = Query(None, ge=0, description="only this rank"),
    ) -> dict[str, Any]:
        """Which source ranks and boxes feed the destination shards of a tensor."""
        try:
            doc, text = explain_document(c, model, tensor, pool, rank)
        except ControlError as e:
            raise HTTPException(HTTP_STATUS[e.kind], e.message) from e
        return {**doc, "text": text}

    @app.get("/", response_class=HTMLResponse, dependencies=guarded)
    def index(request: Request) -> HTMLResponse:
        """The status page; a `?token=` login is kept in a cookie for its own fetches."""
        response = HTMLResponse(page)
        token = request.query_params.get("token", "")
        if c.security.token and token:
            response.set_cookie(
                TOKEN_COOKIE,
                token,
                httponly=True,
                samesite="strict",
                secure=c.security.tls,
            )
        return response

    return app


class HttpServer:
    """uvicorn serving the ops app on a socket bound and listening before the thread starts."""

    def __init__(self, c: OpsBackend, host: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.sock.listen(socket.SOMAXCONN)  # a client connecting before the thread runs waits
        config = uvicorn.Config(
            build_app(c),
            log_level="warning",
            access_log=False,
            lifespan="off",
            **c.security.uvicorn_ssl(),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
