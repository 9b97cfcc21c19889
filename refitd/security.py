"""TLS credentials and the bearer token as both ends of a gRPC channel use them.

The controller, node agents, workers and the CLI all derive what they need from one
`Settings` (refitd.config), so a deployment turns TLS or the token on in one place:
`ServerSecurity` is what the controller serves with, `ClientSecurity` what every channel to
it dials with. Files, the token and the rendezvous-store secret are read and derived in
refitd.credentials. Nothing here touches gRPC servicers or tensor bytes.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from refitd.credentials import read_credential, resolve_token

if TYPE_CHECKING:  # a type only: workers and agents do not load the settings model
    from refitd.config import Settings

AUTH_HEADER = "authorization"
BEARER = "Bearer "
TOKEN_COOKIE = "refitd_token"


def tokens_equal(presented: str, expected: str) -> bool:
    """Constant-time comparison (the time does not depend on where they differ)."""
    return hmac.compare_digest(presented.encode(), expected.encode())


def bearer_token(header_value: str) -> str:
    """The token of an 'authorization: Bearer <token>' value ('' when not a bearer value)."""
    if header_value[: len(BEARER)].lower() == BEARER.lower():
        return header_value[len(BEARER) :].strip()
    return ""


@dataclass(frozen=True)
class ServerSecurity:
    """What the controller serves with: TLS material (PEM bytes) and the token."""

    cert: bytes = b""
    key: bytes = b""
    ca: bytes = b""
    require_client_cert: bool = False
    token: str = ""
    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> ServerSecurity:
        return cls(
            cert=read_credential(settings.tls_cert, "tls_cert") if settings.tls_cert else b"",
            key=read_credential(settings.tls_key, "tls_key") if settings.tls_key else b"",
            ca=read_credential(settings.tls_ca, "tls_ca") if settings.tls_ca else b"",
            require_client_cert=settings.require_client_cert,
            token=resolve_token(settings.auth_token, settings.auth_token_file),
            cert_path=settings.tls_cert,
            key_path=settings.tls_key,
            ca_path=settings.tls_ca,
        )

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """TLS server credentials; client certificates required (mTLS) when configured."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca or None,
            require_client_auth=self.require_client_cert,
        )

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Bind the gRPC port: TLS when a certificate is configured, plaintext otherwise."""
        if self.tls:
            return server.add_secure_port(address, self.grpc_credentials())
        return server.add_insecure_port(address)

    def uvicorn_ssl(self) -> dict[str, Any]:
        """uvicorn.Config keyword arguments for HTTPS (empty without TLS)."""
        if not self.tls:
            return {}
        import ssl

        kw: dict[str, Any] = {"ssl_certfile": self.cert_path, "ssl_keyfile": self.key_path}
        if self.ca_path:
            kw["ssl_ca_certs"] = self.ca_path
            kw["ssl_cert_reqs"] = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE
        return kw


@dataclass(frozen=True)
class ClientSecurity:
    """What a channel to the controller dials with: TLS roots, client cert, the token."""

    tls: bool = False
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = b""
    server_name: str = ""
    token: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientSecurity:
        """TLS when the deployment has a CA, a client cert or a server cert of its own.

        The embedded agent of `refitd serve` shares the controller's settings: without a
        separate client certificate it presents the controller's (which then needs the
        clientAuth usage, or none), and without tls_ca it trusts the controller's
        certificate itself.
        """
        cert_path = settings.tls_client_cert or settings.tls_cert
        key_path = settings.tls_client_key or settings.tls_key
        ca_path = settings.tls_ca or settings.tls_cert
        tls = bool(settings.tls_ca or settings.tls_client_cert or settings.tls_cert)
        return cls(
            tls=tls,
            ca=read_credential(ca_path, "tls_ca") if tls and ca_path else b"",
            cert=read_credential(cert_path, "tls_client_cert") if tls and cert_path else b"",
            key=read_credential(key_path, "tls_client_key") if tls and key_path else b"",
            server_name=settings.tls_server_name,
            token=resolve_token(settings.auth_token, settings.auth_token_file),
        )

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A gRPC channel to `address`: TLS (and the client cert) when configured.

        The bearer token rides on every call through call credentials when TLS is on, and
        through an interceptor on plaintext channels (gRPC refuses call credentials there).
        """
        opts = list(options or [])
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        if self.tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=self.ca or None,
                private_key=self.key or None,
                certificate_chain=self.cert or None,
            )
            if self.token:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.access_token_call_credentials(self.token)
                )
            return grpc.secure_channel(address, creds, options=opts)
        channel = grpc.insecure_channel(address, options=opts)
        if self.token:
            channel = grpc.intercept_channel(channel, TokenInterceptor(self.token))
        return channel

    def http_headers(self) -> dict[str, str]:
        """Headers for the ops HTTP API (the status document)."""
        return {AUTH_HEADER: BEARER + self.token} if self.token else {}


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = getattr(base, "compression", None)


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds 'authorization: Bearer <token>' to every call of a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._header = (AUTH_HEADER, BEARER + token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTH_HEADER]
        return _CallDetails(details, [*metadata, self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
