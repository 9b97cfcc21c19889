"""A node agent registers again by itself when its controller restarts on the same port."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pb_grpc
from refitd.config import load_settings
from refitd.demo.run import free_port
from refitd.node.agent import run_node_agent
from refitd.server.controller import Controller

pytestmark = pytest.mark.slow


def _connected_slots(address: str) -> list[bool]:
    with grpc.insecure_channel(address) as channel:
        try:
            doc = json.loads(
                pb_grpc.RefitStub(channel).GetStatus(pb.StatusRequest(), timeout=2).json
            )
        except grpc.RpcError:
            return []
    return [bool(s.get("connected")) for s in doc.get("slots", [])]


def _wait_connected(address: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(_connected_slots(address)):
            return True
        time.sleep(0.2)
    return False


def test_agent_reregisters_after_controller_restart(tmp_path: Path) -> None:
    settings = load_settings(grpc_port=free_port(), http_port=0, data_dir=tmp_path, cpu_slots=1)
    controller = Controller(settings).start()
    address = controller.grpc_address
    stop = threading.Event()
    agent = threading.Thread(
        target=run_node_agent, args=(address, socket.gethostname(), ["cpu:0"], settings, stop)
    )
    agent.start()
    try:
        assert _wait_connected(address, 60)
        controller.stop()
        assert not _connected_slots(address)
        controller = Controller(settings).start()
        assert _wait_connected(address, 30)
    finally:
        stop.set()
        agent.join(30)
        controller.stop()
    assert not agent.is_alive()
