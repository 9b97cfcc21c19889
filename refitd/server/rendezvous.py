"""The data-plane rendezvous store (a torch TCPStore), hosted in a small child process.

Transfer processes build their refit communicator from this store. It lives in its own
process so the controller itself never imports torch. The controller binds and listens on
the port itself and hands the socket to the child (TCPStore's `master_listen_fd`), so the
address is known at once and the controller's start does not wait for the child's torch
import: clients that connect meanwhile wait in the listen backlog. The child exits when its
stdin closes, so it dies with the controller even on kill -9.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass

LISTEN_BACKLOG = 1024


def listen_any(port: int) -> socket.socket:
    """A socket listening on every interface (IPv6 and IPv4 where the host has IPv6), as
    TCPStore's own server does."""
    if socket.has_dualstack_ipv6():
        sock = socket.create_server(
            ("::", port), family=socket.AF_INET6, backlog=LISTEN_BACKLOG, dualstack_ipv6=True
        )
    else:
        sock = socket.create_server(("0.0.0.0", port), backlog=LISTEN_BACKLOG)
    return sock


@dataclass
class RendezvousStore:
    """Handle on the child process hosting the TCPStore."""

    host: str
    port: int
    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, host: str, port: int) -> RendezvousStore:
        """Bind the store's port and start its child; returns without waiting for the child."""
        try:
            sock = listen_any(port)
        except OSError as e:
            raise RuntimeError(f"rendezvous store: cannot listen on port {port}: {e}") from e
        with sock:
            fd, bound = sock.fileno(), sock.getsockname()[1]
            proc = subprocess.Popen(
                [sys.executable, "-m", "refitd.server.rendezvous", host, str(bound), str(fd)],
                stdin=subprocess.PIPE,
                pass_fds=(fd,),
            )
            return cls(host, bound, proc)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def _serve(host: str, port: int, listen_fd: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(  # noqa: F841 - serves while referenced
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=300),
        master_listen_fd=listen_fd,
    )
    sys.stdin.buffer.read()  # until the controller closes our stdin (or dies)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
