"""The agent's data-plane address: configured, from GLOO_SOCKET_IFNAME, or from the route to
the controller; never from hostname resolution. A loopback one with a remote controller is
refused with the setting that fixes it. Communicator set-up errors say what, where, when."""

from __future__ import annotations

import re
import time

import pytest

from refitd.config import load_settings
from refitd.node.address import DataPlaneError, choose_data_plane
from refitd.transport.base import ConnectInfo, TransportError
from refitd.transport.gloo import GlooTransport, describe_failure


def test_default_is_the_route_to_the_controller(tmp_path) -> None:
    plane = choose_data_plane(load_settings(data_dir=tmp_path), "127.0.0.1:50151", env={})
    assert (plane.address, plane.source) == ("127.0.0.1", "route")


def test_interface_and_gloo_socket_ifname(tmp_path) -> None:
    s = load_settings(data_dir=tmp_path, data_plane_interface="lo")
    plane = choose_data_plane(s, "127.0.0.1:1", env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert (plane.address, plane.interface, plane.source) == ("127.0.0.1", "lo", "interface")
    plane = choose_data_plane(load_settings(data_dir=tmp_path), "127.0.0.1:1", env={
        "GLOO_SOCKET_IFNAME": "lo,eth0"
    })  # fmt: skip
    assert (plane.interface, plane.source) == ("lo", "GLOO_SOCKET_IFNAME")
    with pytest.raises(DataPlaneError, match="'nosuch0' has no IPv4 address"):
        choose_data_plane(
            load_settings(data_dir=tmp_path), "127.0.0.1:1", env={"GLOO_SOCKET_IFNAME": "nosuch0"}
        )


def test_loopback_with_a_remote_controller_is_refused(tmp_path) -> None:
    # Nothing is sent: the controller's address is only compared, never dialled.
    s = load_settings(data_dir=tmp_path, data_plane_address="127.0.0.1")
    with pytest.raises(DataPlaneError) as e:
        choose_data_plane(s, "10.213.250.1:50151", env={})
    msg = str(e.value)
    assert "127.0.0.1 (from --data-plane-address) is a loopback address" in msg
    assert "10.213.250.1:50151" in msg and "--data-plane-interface" in msg
    with pytest.raises(DataPlaneError, match="GLOO_SOCKET_IFNAME=lo"):
        choose_data_plane(
            load_settings(data_dir=tmp_path), "10.213.250.1:1", env={"GLOO_SOCKET_IFNAME": "lo"}
        )


@pytest.mark.parametrize("controller", ["10.213.250.1", "10.213.250.1:port", "[fd00::1]"])
def test_a_controller_address_without_a_port_is_named(tmp_path, controller: str) -> None:
    s = load_settings(data_dir=tmp_path, data_plane_address="127.0.0.1")
    with pytest.raises(DataPlaneError, match=f"controller address '{re.escape(controller)}'"):
        choose_data_plane(s, controller, env={})


def test_refused_connection_is_told_as_such() -> None:
    info = ConnectInfo(epoch=3, store_host="10.0.0.1", store_port=1, rank=1, world_size=3,
                       timeout_s=20.0)  # fmt: skip
    # The shape of the error torch's gloo raises for a peer that advertised loopback.
    err = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [127.0.0.1]:41563: "
        "Connection refused, remote=[127.0.0.1]:41563"
    )
    msg = describe_failure("gloo communicator", info, "10.213.0.3", 0.031, err)
    assert msg.startswith("rank 1/3 at 10.213.0.3 -> peer [127.0.0.1]:41563: gloo communicator")
    assert "failed after 0.03s of its 20s timeout" in msg and "Connection refused" in msg
    assert "not formed within" not in msg and "--data-plane-address" in msg


def test_absent_peer_is_a_timeout_after_the_timeout(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = ConnectInfo(epoch=1, store_host="127.0.0.1", store_port=store.port, rank=0,
                       world_size=2, timeout_s=1.0, local_address="127.0.0.1")  # fmt: skip
    t = GlooTransport()
    t0 = time.monotonic()
    with pytest.raises(TransportError) as e:
        t.connect(info)
    assert time.monotonic() - t0 >= 0.9
    assert "rank 0/2 at 127.0.0.1: gloo communicator of epoch 1 timed out after" in str(e.value)
    assert "a peer did not join" in str(e.value)


def test_serve_refuses_a_loopback_embedded_agent_of_an_advertised_controller(tmp_path) -> None:
    """Refused before anything binds or dials (the advertised address is only compared)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "refitd.cli.main", "serve", "--grpc-port", "0",
         "--http-port", "0", "--data-dir", str(tmp_path), "--advertise-host", "10.213.250.1",
         "--data-plane-address", "127.0.0.1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "embedded agent: refusing to start" in proc.stderr
    assert "agents of other hosts reach this one at 10.213.250.1" in proc.stderr
