"""A child process whose stdout lines a test waits on (tests that kill and restart members)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time


class ChildLines:
    """Runs `args` with piped stdin/stdout; `expect` waits for the next line starting with a
    prefix, dropping the lines before it."""

    def __init__(self, args: list[str], what: str, **popen: object) -> None:
        self.what = what
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith(prefix):
                return line
        raise AssertionError(f"{self.what} never printed {prefix!r}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
