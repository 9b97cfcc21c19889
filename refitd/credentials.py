"""Credentials that need neither gRPC nor the settings: credential files read with a clear
error, the bearer token, and the rendezvous-store secret derived from it.

refitd.config derives the store secret from the token when the settings are read;
refitd.security builds each end's TLS and token from the settings with these.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

STORE_SECRET_CONTEXT = b"refitd rendezvous store prefix v1"


def read_credential(path: str, what: str) -> bytes:
    """The bytes of a credential file (`what` names the setting in the error)."""
    p = Path(path).expanduser()
    try:
        return p.read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} cannot be read: {e.strerror}") from None


def resolve_token(auth_token: str, auth_token_file: str) -> str:
    """The bearer token: `auth_token`, else the first line of `auth_token_file`, else ''."""
    if auth_token:
        return auth_token.strip()
    if auth_token_file:
        text = read_credential(auth_token_file, "auth_token_file").decode().strip()
        if not text:
            raise ValueError(f"auth_token_file {auth_token_file!r} is empty")
        return text.splitlines()[0].strip()
    return ""


def store_secret(token: str) -> str:
    """Per-deployment key prefix of the rendezvous TCPStore, derived from the bearer token.

    Agents receive it in ConnectCommand (over the authenticated, optionally TLS, gRPC
    stream); a process without the token cannot compute it, so it cannot guess the keys
    of a refit communicator. Empty without a token.
    """
    if not token:
        return ""
    return hmac.new(token.encode(), STORE_SECRET_CONTEXT, hashlib.sha256).hexdigest()[:32]
