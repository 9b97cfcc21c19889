"""The data-plane rendezvous store (a torch TCPStore), hosted in a small child process.

Transfer processes build their refit communicator from this store. It lives in its own
process so the controller itself never imports torch. The child exits when its stdin
closes, so it dies with the controller even on kill -9.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass


@dataclass
class RendezvousStore:
    """Handle on the child process hosting the TCPStore."""

    host: str
    port: int
    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, host: str, port: int, timeout_s: float = 60.0) -> RendezvousStore:
        """Start the store child and wait (bounded) until it listens; returns its address."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "refitd.server.rendezvous", host, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0].strip().isdigit():
            proc.kill()
            proc.wait(5)
            raise RuntimeError(
                f"rendezvous store on {host}:{port} did not start within {timeout_s:g}s"
            )
        return cls(host, int(line[0]), proc)

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


def _serve(host: str, port: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    print(store.port, flush=True)
    sys.stdin.buffer.read()  # until the controller closes our stdin (or dies)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
