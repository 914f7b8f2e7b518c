"""A request's life (core.requests), shared by continuous batching and vLLM, and the one kind of step score that
every engine's row reader returns (core.scores.SCORES)."""
import pytest
import torch

from macs_kernels.core.config import MacsConfig
from macs_kernels.core.requests import Requests
from macs_kernels.core.rows import RowStore
from macs_kernels.core.scores import SCORES, step_scores
from macs_kernels.engines.continuous import ContinuousTracer
from macs_kernels.engines.generate import attach
from tests.helpers import tiny_llama


def _log_z(log_c: torch.Tensor) -> torch.Tensor:
    """Each row's z-scores over its finite entries (population deviation), computed here from the definition."""
    out = torch.empty_like(log_c)
    for r, row in enumerate(log_c.double()):
        finite = row[torch.isfinite(row)]
        z = (row - finite.mean()) / finite.std(unbiased=False)
        out[r] = torch.where(torch.isfinite(row), z, row).float()
    return out


def _row(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_a_request_opens_with_its_options_resumes_after_a_restart_and_waits_for_its_reader():
    store = RowStore()
    requests = Requests(store, default="default options")
    requests.configure("a", "a's options")
    first, restarted = object(), object()
    assert requests.admit("a", 2, 0, first) and requests.admit("b", 2, 0, first)
    assert store.config("a") == "a's options" and store.config("b") == "default options"
    requests.put([("a", 0), ("b", 0)], torch.stack([_row(1, 2, 9), _row(3, 4, 9)]), torch.tensor([False, False]))
    with pytest.raises(RuntimeError, match="already running"):
        requests.configure("a", "late")
    assert requests.admit("a", 2, 1, first)  # the same run: no reopening
    requests.put([("a", 1)], _row(5, 6)[None], torch.tensor([False]))
    # The engine restarted "a" (a new handle) and replays it up to step 2: its rows resume.
    assert requests.admit("a", 2, 2, restarted) and requests.handle("a") is restarted
    requests.put([("a", 2)], _row(7, 8)[None], torch.tensor([False]))
    assert torch.equal(store.rows("a"), torch.arange(1.0, 9.0).view(4, 2)[[0, 2, 3]])
    requests.finish("a")
    assert not requests.running("a") and torch.equal(store.rows("a")[2], _row(7, 8))  # kept for the reader
    requests.release("a")
    with pytest.raises(KeyError, match="released"):
        store.rows("a")


def test_a_request_released_while_it_runs_gets_no_more_rows_and_is_forgotten_when_it_finishes():
    store = RowStore()
    requests = Requests(store)
    handle = object()
    assert requests.admit("a", 2, 0, handle)
    requests.release("a")
    assert requests.running("a") and requests.released("a")
    assert not requests.admit("a", 2, 1, handle)
    requests.put([("a", 1)], _row(1, 2)[None], torch.tensor([False]))  # a pass already under way: discarded
    requests.finish("a")
    assert not requests.released("a") and "a" not in store
    # Released while the engine restarted it: not opened again.
    assert requests.admit("b", 2, 0, handle)
    requests.finish("b")
    requests.release("b")
    assert not requests.admit("b", 2, 3, object()) and "b" not in store


def test_a_finished_handle_frees_a_release_at_once_and_skipped_requests_wait_for_release():
    state = {"finished": False}
    store = RowStore()
    requests = Requests(store, finished=lambda handle: handle["finished"])
    assert requests.admit("a", 1, 0, state)
    state["finished"] = True  # the engine finished the state before the tracer saw its next pass
    assert not requests.running("a")
    requests.release("a")
    assert not requests.released("a") and requests.runs() == []
    requests.skip("s")
    assert not requests.admit("s", 1, 0, object())
    requests.release("s")
    assert requests.admit("s", 1, 0, object())


def test_a_broken_row_fails_its_request_only():
    store = RowStore()
    requests = Requests(store)
    for key in ("a", "b"):
        requests.admit(key, 2, 0)
    requests.put([("a", 0), ("b", 0)], torch.stack([_row(1, 2), _row(3, 4)]), torch.tensor([True, False]))
    with pytest.raises(FloatingPointError, match="NaN in an attention row"):
        store.rows("a")
    assert torch.equal(store.rows("b"), _row(3, 4)[None])


def test_every_engine_reader_returns_the_z_scores_of_log_c():
    log_c = torch.tensor([[0.0, -30.0, -31.0, float("-inf")], [-2.0, -1.0, -5.0, -3.0]])
    assert torch.allclose(step_scores(log_c), _log_z(log_c), atol=1e-6, equal_nan=False)
    assert SCORES["log_z"].per_step and not SCORES["max_z"].per_step
    with pytest.raises(ValueError, match="unknown step score 'max_z'"):
        step_scores(log_c, "max_z")

    continuous = ContinuousTracer(MacsConfig(), num_layers=1, device=torch.device("cpu"))
    continuous.requests.admit("r", 4, 0)
    continuous.requests.put([("r", 0), ("r", 1)], log_c, torch.tensor([False, False]))
    rows, scores = continuous.request_rows("r")
    assert torch.equal(rows, log_c) and torch.equal(scores, step_scores(log_c))

    model = tiny_llama()
    with torch.no_grad(), attach(model) as tracer:
        model.generate(torch.tensor([[1, 5, 9, 14, 20]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    rows, scores = tracer.rows(0)
    assert rows.shape == (3, 5)
    torch.testing.assert_close(scores, _log_z(rows), atol=1e-5, rtol=0)
    torch.testing.assert_close(tracer.row(0, 2)[1], scores[2], atol=1e-6, rtol=0)
