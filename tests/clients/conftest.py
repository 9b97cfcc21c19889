"""One real `refitd serve` (controller + embedded agent + transfer processes) shared by the
adapter tests of this folder; each test uses its own model name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refitd.demo.run import Daemon


@pytest.fixture(scope="package")
def daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=4, extra_args=["--pause-timeout-s", "20", "--log-level", "info"])
    d.start()
    try:
        yield d
    finally:
        d.stop()
