"""`refitd agent --controller HOST:PORT --devices cpu:0,cpu:1`: join a controller as a node agent.

Runs until interrupted (SIGINT/SIGTERM); reconnects and registers again when the
controller restarts.
"""

from __future__ import annotations

import argparse
import socket
import sys

from refitd.cli.daemon_process import start_daemon_process
from refitd.config import add_settings_arguments, settings_from_args

AGENT_FIELDS = [
    "controller",
    "devices",
    "data_plane_address",
    "data_plane_interface",
    "rdma_protocol",
    "rdma_devices",
    "rdma_auto",
    "rdma_landing_bytes",
    "cpu_slots",
    "rpc_timeout_s",
    "connect_timeout_s",
    "load_timeout_s",
    "transfer_timeout_s",
    "staging_bytes",
    "snapshot_bytes",
    "heartbeat_timeout_s",
    "log_level",
    "tls_ca",
    "tls_client_cert",
    "tls_client_key",
    "tls_server_name",
    "auth_token",
    "auth_token_file",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, AGENT_FIELDS)
    parser.add_argument(
        "--hostname",
        default=None,
        help="name of this host as workers give it (default: socket.gethostname())",
    )


def run(args: argparse.Namespace) -> int:
    from refitd.node.address import DataPlaneError, choose_data_plane
    from refitd.node.agent import run_node_agent

    settings = settings_from_args(args)
    host = args.hostname or socket.gethostname()
    try:
        plane = choose_data_plane(settings, settings.controller)
    except DataPlaneError as e:
        print(f"refitd agent {host}: refusing to start: {e}", file=sys.stderr, flush=True)
        return 2
    stop = start_daemon_process(settings)
    devices = settings.local_devices()
    print(
        f"refitd agent {host}: slots {','.join(devices)} -> controller {settings.controller}, "
        f"data plane {plane.describe()}",
        flush=True,
    )
    run_node_agent(settings.controller, host, devices, settings, stop, plane)
    return 0
