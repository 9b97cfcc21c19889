"""The allow_dtype_cast setting: every settings source reaches it, and by default a refit
into a destination of another dtype fails at plan time naming the setting and its flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from refitd._proto import refitd_pb2 as pb
from refitd.cli.main import build_parser
from refitd.config import load_settings, settings_from_args

from .conftest import Cluster
from .peers import Subscriber, row_shard


def test_every_settings_source_reaches_allow_dtype_cast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REFITD_ALLOW_DTYPE_CAST", raising=False)
    monkeypatch.delenv("REFITD_CONFIG", raising=False)
    assert load_settings(None).allow_dtype_cast is False
    argv = ["serve", "--allow-dtype-cast"]
    assert settings_from_args(build_parser(argv).parse_args(argv)).allow_dtype_cast is True
    toml = tmp_path / "refitd.toml"
    toml.write_text("allow_dtype_cast = true\n")
    assert load_settings(toml).allow_dtype_cast is True
    monkeypatch.setenv("REFITD_ALLOW_DTYPE_CAST", "1")
    assert load_settings(None).allow_dtype_cast is True
    argv = ["serve", "--no-allow-dtype-cast"]  # a flag beats the environment
    assert settings_from_args(build_parser(argv).parse_args(argv)).allow_dtype_cast is False


@pytest.mark.slow
def test_dtype_mismatch_fails_the_refit_naming_the_setting(cluster: Cluster) -> None:
    t = row_shard("w", 4, 8, 0, 1)
    t.dtype = "bfloat16"  # the trainer pool holds float32
    resp = cluster.stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            model=cluster.model,
            pool="bf16",
            role=pb.ROLE_DESTINATION,
            rank=0,
            pool_size=1,
            host=cluster.host,
            device="cpu:2",
            pid=300,
            tensors=[t],
        ),
        timeout=10,
    )
    cluster.subscribers.append(Subscriber(cluster.stub, resp.worker_id).start())
    for got in cluster.refit(1):
        assert isinstance(got, pb.RefitResponse), got
        assert got.state == pb.REFIT_STATE_FAILED, got
        assert "dtype mismatch: tensor 'w' (canonical 'w'), pool 'bf16', rank 0 is bfloat16" in (
            got.message
        )
        assert "set allow_dtype_cast (refitd serve --allow-dtype-cast" in got.message, got
