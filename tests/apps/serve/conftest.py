"""A real `macs-kernels serve` process on a free loopback port, one per test module."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from tests.helpers import TINY, skip_where_continuous_batching_is_refused, tiny_chat_model

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install -e .[serve]")
pytest.importorskip("uvicorn", reason="the server needs the serve extra: pip install -e .[serve]")
httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")


class TokenizerProxy:
    """A tokenizer that behaves as `tokenizer` does; subclasses replace the calls a test wants to hold."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self):
        return len(self._tokenizer)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server subprocess: `url`, `log()` (its output so far), `terminate()` (SIGTERM, then wait)."""

    def __init__(self, *args: str, startup_s: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile("w+")
        command = [sys.executable, "-m", "macs_kernels.apps.serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--threads", "1", "--cache-tokens", "4096", *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                skip_where_continuous_batching_is_refused(self.log())  # text models are served on it
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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(folder, model, tokenizer) of the tiny chat model, loaded back from its folder as the server loads it."""
    from macs_kernels.api.models import load_model

    folder = tmp_path_factory.mktemp("tiny_chat_model")
    tiny_chat_model(folder)
    model, tokenizer = load_model(str(folder))
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def server(tiny_model):
    running = Server("--model", str(tiny_model[0]), "--served-name", TINY)
    yield running
    running.terminate()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's server."""
    openai = pytest.importorskip("openai", reason="the server tests need the official openai client (the test extra)")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def lm(tiny_model):
    return tiny_model[1], tiny_model[2]


LOG_C_TOL = 1e-3


def rows(values) -> torch.Tensor:
    return torch.tensor([[float("-inf") if v is None else v for v in row] for row in values])


def assert_matches(attribution: dict, reference, text: str):
    """The server's attribution equals explain()'s: same ids and tokens, step_log_c within LOG_C_TOL."""
    assert attribution["input_ids"] == reference.input_ids.tolist()
    assert attribution["generated_ids"] == reference.generated_ids.tolist()
    assert attribution["generated_tokens"] == reference.generated_tokens
    assert text == reference.text
    log_c = rows(attribution["step_log_c"])
    assert log_c.shape == reference.step_log_c.shape
    assert torch.allclose(log_c, reference.step_log_c, atol=LOG_C_TOL, rtol=0)
    scores = torch.tensor(attribution["step_scores"])
    assert torch.allclose(scores, reference.step_scores, atol=1e-3, rtol=0)
