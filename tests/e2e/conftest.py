"""A real `refitd serve` (controller + embedded agent + transfer processes) on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refitd.demo.run import Daemon


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=4, extra_args=["--pause-timeout-s", "20", "--log-level", "info"])
    d.start()
    try:
        yield d
    finally:
        d.stop()
