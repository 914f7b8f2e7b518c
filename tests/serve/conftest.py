"""A real `macs-kernels serve` process on a free loopback port, one per test module."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install -e .[serve]")
pytest.importorskip("uvicorn", reason="the server needs the serve extra: pip install -e .[serve]")
httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")

from macs_kernels.models import DEFAULT_MODEL  # noqa: E402

MODEL = DEFAULT_MODEL


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server subprocess: `url`, `log()` (its output so far), `terminate()` (SIGTERM, then wait)."""

    def __init__(self, *args: str, startup_s: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(f"/tmp/macs_serve_{self.port}.log", "w+")
        command = [sys.executable, "-m", "macs_kernels.serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--threads", "1", "--cache-tokens", "4096", *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.process.kill()
        raise TimeoutError(f"the server did not answer /health within {startup_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def terminate(self, timeout: float = 120) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


@pytest.fixture(scope="module")
def server():
    running = Server()
    yield running
    running.terminate()
