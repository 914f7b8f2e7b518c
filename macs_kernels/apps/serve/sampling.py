"""Per-request sampling inside transformers' continuous batching: each request its own temperature, top_k,
top_p and random generator, so that a seeded request draws the same tokens whatever else is in the batch.

The manager samples every row of a pass alike (one generation config, one global random stream). The server's
manager decodes greedily; `RequestSampler` is its one logits processor: for a row whose request samples, it
draws the token from that request's own generator (temperature, top-k and top-p as generate applies them) and
leaves only that token finite, so the manager's argmax takes it; greedy rows are left as they are.
"""
from __future__ import annotations

import dataclasses
import threading

import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request draws its tokens; temperature 0 is greedy (the other fields then change nothing, as
    the most likely token survives every top-k and top-p filter)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class _Draw:
    """One sampling request's warpers and generator (made on the logits' device at its first token)."""

    def __init__(self, sampling: Sampling):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = [] if sampling.temperature == 1 else [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k is not None:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p is not None and sampling.top_p < 1:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        self.warpers = LogitsProcessorList(warpers)  # generate's order: temperature, top-k, top-p
        self.seed = sampling.seed
        self.generator: torch.Generator | None = None

    def token(self, logits: torch.Tensor) -> int:
        """One token drawn from `logits` (V,) float32."""
        if self.generator is None:
            self.generator = torch.Generator(device=logits.device)
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)
        scores = self.warpers(None, logits[None].float())  # a float16 row overflows at small temperatures
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class RequestSampler:
    """A continuous-batching logits processor that samples each configured request on its own.

    `install(manager)` before the manager starts; `configure(request_id, Sampling)` before adding a request
    that samples, `release(request_id)` after it. Thread-safe: the engine's loop calls it in its own thread.
    A request whose draw fails is not drawn again and its failure kept for `failure(request_id)`: an exception
    raised here would stop the manager, and every request with it.
    """

    supports_continuous_batching = True

    def __init__(self):
        self._lock = threading.Lock()
        self._draws: dict[str, _Draw] = {}
        self._failures: dict[str, BaseException] = {}
        self._manager = None

    def install(self, manager) -> None:
        """Make this the manager's only logits processor (its generation config must add none: greedy)."""
        from transformers import LogitsProcessorList
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList,
        )

        if manager.batch_processor is not None:
            raise RuntimeError("install the sampler before the manager starts")
        if manager.logit_processor.do_processing:
            raise RuntimeError(f"the manager already processes logits ({manager.logit_processor}); "
                               "its generation config must decode greedily")
        self._manager = manager
        manager.logit_processor = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([self]))

    def configure(self, request_id: str, sampling: Sampling) -> None:
        if not sampling.greedy:
            with self._lock:
                self._draws[request_id] = _Draw(sampling)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._draws.pop(request_id, None)
            self._failures.pop(request_id, None)

    def failure(self, request_id: str) -> BaseException | None:
        """Why the request's draw failed, or None."""
        with self._lock:
            return self._failures.get(request_id)

    def __call__(self, _input_ids, scores: torch.Tensor) -> torch.Tensor:
        """scores (rows, V), a row per request of the pass: row r < E belongs to the r-th of the E requests that
        emit a token (the engine lays out logits_indices so); the rows after them are not used."""
        if not self._draws:  # every request greedy: the manager's argmax as it is
            return scores
        batch = self._manager.batch_processor.inputs_and_outputs.requests_in_batch
        emitting = [future.state.request_id for future in batch if future.has_new_token]
        if len(emitting) > scores.shape[0]:
            raise RuntimeError(f"{scores.shape[0]} logits rows for {len(emitting)} requests that emit a token")
        with self._lock:
            draws = [(row, self._draws.get(request_id)) for row, request_id in enumerate(emitting)]
        for (row, draw), request_id in zip(draws, emitting):
            if draw is None:
                continue
            try:
                token = draw.token(scores[row])
            except Exception as error:  # noqa: BLE001 - the request's own failure; its row is left greedy
                with self._lock:
                    self._draws.pop(request_id, None)
                    self._failures[request_id] = error
                continue
            scores[row] = float("-inf")
            scores[row, token] = 0.0
        return scores


class SequenceSampler:
    """A generate() logits processor for one sequence drawn as `RequestSampler` draws a request's tokens (its
    own generator, warpers and seed): generate decodes greedily and takes the one token left finite, so the same
    request with the same seed gets the same tokens on either engine."""

    def __init__(self, sampling: Sampling):
        self.draw = _Draw(sampling)

    def __call__(self, _input_ids, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != 1:
            raise RuntimeError(f"SequenceSampler draws one sequence; generate passed {scores.shape[0]} rows")
        token = self.draw.token(scores[0])
        drawn = torch.full_like(scores, float("-inf"))
        drawn[0, token] = 0.0
        return drawn
