"""`refitd serve [--cpu-slots N]`: the controller and, embedded, the local node agent.

The embedded agent runs in a thread of this process and talks gRPC over loopback like any
other agent; its transfer processes are child processes. Runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading

from refitd.cli.daemon_process import start_daemon_process
from refitd.config import add_settings_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument(
        "--hostname",
        default=None,
        help="host name of the embedded agent's slots (default: socket.gethostname())",
    )


def run(args: argparse.Namespace) -> int:
    from refitd.server.controller import Controller
    from refitd.server.readiness import LocalAgent

    settings = settings_from_args(args)
    devices = settings.local_devices()
    plane = None
    if settings.embedded_agent and devices:
        from refitd.node.address import DataPlaneError, choose_data_plane

        try:  # peers reach the embedded agent where agents reach the store
            plane = choose_data_plane(
                settings,
                f"{settings.store_host}:{settings.grpc_port}",
                reached_as=f"agents of other hosts reach this one at {settings.store_host} "
                "(advertise_host, else host)",
            )
        except DataPlaneError as e:
            print(f"refitd serve: embedded agent: refusing to start: {e}", file=sys.stderr)
            return 2
    stop = start_daemon_process(settings)
    if plane is not None:  # the fork server imports torch while the controller starts
        from refitd.node.process_handle import start_transfer_server

        start_transfer_server()
    host = args.hostname or socket.gethostname()
    local = LocalAgent(host, tuple(devices)) if plane is not None else None
    controller = Controller(settings, local).start()  # ready once this agent connects
    agent_thread = None
    if plane is not None:
        from refitd.node.agent import run_node_agent

        agent_thread = threading.Thread(
            target=run_node_agent,
            args=(controller.grpc_address, host, devices, settings, stop, plane),
            name="local-agent",
            daemon=True,
        )
        agent_thread.start()
    print(
        f"refitd serving: gRPC {controller.grpc_address}, status http://{controller.http_address}/"
        f", store {controller.store_address_str or 'off'}, state {controller.db.path}"
        + (
            f", local agent slots {','.join(devices)}, data plane {plane.describe()}"
            if plane is not None
            else ""
        ),
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        if agent_thread is not None:
            agent_thread.join(timeout=10)
        controller.stop()
    return 0
