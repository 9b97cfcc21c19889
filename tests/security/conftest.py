"""Controllers on 127.0.0.1 (ephemeral ports, state under tmp_path) with TLS and/or a token."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from refitd.config import Settings, load_settings
from refitd.server.controller import Controller

from .certs import Pki, make_pki


def settings(data_dir: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        grpc_port=0, http_port=0, data_dir=data_dir, grpc_workers=16, rendezvous=False
    )
    base.update(kw)
    return load_settings(None, **base)


@pytest.fixture(scope="package")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def start_controller(tmp_path: Path) -> Iterator[Callable[..., Controller]]:
    started: list[Controller] = []

    def start(**kw: object) -> Controller:
        c = Controller(settings(tmp_path / f"state{len(started)}", **kw)).start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop(grace_s=0.5)
