"""The evaluation loop: one generation per sample, every method scored from it, results in a resumable stream.

Phase 1 generates and scores every sample with every method; phase 2 runs the faithfulness curves (the
bulk of the time: 11 masked regenerations per method and sample) on the first --faithfulness-n samples
from index --faithfulness-from on.

Nothing is reused by position alone. A sample's content key covers the model settings, the question, the
context and the gold answers; a generation's key covers the model settings and the prompt ids; an AUC-PR
line's key is its sample's plus the method (name, scoring version, AT2's coefficient file); a faithfulness
line's key is its generation's plus the method. A line whose key differs from the one this run computes
is computed again (a later line replaces it), and the generation's rows come from the record cache
whenever that prompt was generated before (record_cache), so a method added later, or corrected gold
answers, cost scoring, not generation. Counts says what was computed and what reused.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from macs_kernels.apps.data_parallel import SINGLE_PROCESS, Shard
from macs_kernels.apps.evaluation.costs import COST_VERSION, GENERATION, cost_line, measure_in_generation, measured
from macs_kernels.apps.evaluation.methods import FAITHFULNESS_METRICS, MODEL_METHODS, Method, method_skips
from macs_kernels.apps.evaluation.record_cache import (
    RECORD_VERSION,
    has_rows,
    load_record,
    load_rows,
    records_dir,
    save_record,
    save_rows,
)
from macs_kernels.apps.evaluation.scoring import RANDOM_SEED, method_identity, method_scores, score_auc
from macs_kernels.apps.evaluation.store import RESULTS_FORMAT, Results, content_key, ids_digest


@dataclasses.dataclass
class EvalSettings:
    model_name: str
    dtype: str
    max_new_tokens: int
    data: str
    faithfulness_n: int
    faithfulness_from: int = 0
    records_root: str | None = None
    backend: str | None = None
    cost_n: int = 0

    def generation(self) -> dict:
        """What a greedy generation depends on besides its prompt."""
        return {"model": self.model_name, "dtype": self.dtype, "max_new_tokens": self.max_new_tokens}


def sample_key(settings: EvalSettings, sample) -> str:
    return content_key({**settings.generation(), "question": sample.question, "context": sample.context,
                        "answers": sample.answers, "problem": sample.problem, "record_version": RECORD_VERSION})


def generation_key(settings: EvalSettings, prompt_ids) -> str:
    return content_key({**settings.generation(), "prompt_ids_sha1": ids_digest(prompt_ids),
                        "record_version": RECORD_VERSION})


@dataclasses.dataclass
class Counts:
    """What a run computed and what it reused."""

    generated: int = 0
    records_reused: int = 0
    samples_reused: int = 0
    auc_scored: int = 0
    auc_reused: int = 0
    faithfulness_computed: int = 0
    faithfulness_reused: int = 0
    rows_computed: int = 0
    rows_reused: int = 0

    def describe(self) -> str:
        return (f"{self.generated} generations this run, {self.records_reused} taken from the record cache; "
                f"samples reused from the results file: {self.samples_reused}; AUC-PR lines: {self.auc_scored} "
                f"scored, {self.auc_reused} reused; faithfulness curves: {self.faithfulness_computed} computed, "
                f"{self.faithfulness_reused} reused; after-generation rows (rollout, attnlrp, atman): "
                f"{self.rows_computed} computed, {self.rows_reused} from the record cache")


class _Sample:
    """One sample's generation: alignment, ids and (lazily) its record and the rows of the model methods."""

    def __init__(self, runner: Runner, sample, alignment, line: dict | None):
        self.runner, self.sample, self.alignment = runner, sample, alignment
        self.prompt_ids = torch.tensor(alignment.input_ids)
        self.generation_key = generation_key(runner.settings, alignment.input_ids)
        self.line = line
        self._record = None
        self._model_rows: dict[str, tuple[np.ndarray, dict]] = {}
        self.generated_ids = None if line is None else torch.tensor(line["generated_ids"])

    def generate(self) -> None:
        from macs_kernels.apps.evaluation.record import generate_record

        runner = self.runner
        record, generated, _ = generate_record(
            runner.model, runner.tokenizer, self.prompt_ids, max_new_tokens=runner.settings.max_new_tokens,
            attentions=runner.attentions, backend=runner.settings.backend,
        )
        if self.generated_ids is not None and not torch.equal(generated, self.generated_ids):
            raise RuntimeError(f"sample {self.sample.index}: regenerating gave another answer than the results file")
        self.generated_ids, self._record = generated, record
        save_record(runner.records, self.generation_key, record, self.prompt_ids, generated)
        runner.counts.generated += 1

    def record(self) -> dict:
        if self._record is None:
            cached = load_record(self.runner.records, self.generation_key, self.prompt_ids)
            if cached is not None and (self.generated_ids is None
                                       or np.array_equal(cached[1], self.generated_ids.numpy())):
                self._record, generated = cached
                self.generated_ids = torch.from_numpy(generated)
                self.runner.counts.records_reused += 1
        if self._record is None or any(f"{a}_rows" not in self._record for a in self.runner.attentions):
            self.generate()
        return self._record

    def model_rows(self, kind: str) -> tuple[np.ndarray, dict]:
        """(steps, N) float64 scores of a method computed from the model (MODEL_METHODS), teacher-forced on this
        sample's generation, and what computing them cost (costs.measured); kept in the record cache."""
        if kind not in self._model_rows:
            runner = self.runner
            if self.generated_ids is None:  # a sample with no results line yet: its generation is the record's
                self.record()
            cached = load_rows(runner.records, self.generation_key, kind, self.generated_ids.numpy())
            if cached is not None:
                runner.counts.rows_reused += 1
                self._model_rows[kind] = cached[0].astype(np.float64), cached[1]
                return self._model_rows[kind]
            model, prompt, generated = runner.model, self.prompt_ids, self.generated_ids
            with measured(next(model.parameters()).device) as cost:
                if kind == "rollout":
                    from macs_kernels.apps.evaluation.record import rollout_rows

                    rows = rollout_rows(model, prompt, generated)
                elif kind == "attnlrp":
                    from macs_kernels.apps.evaluation.baselines import attnlrp

                    rows = attnlrp.relevance(model, prompt, generated).double().numpy()
                else:
                    from macs_kernels.apps.evaluation.baselines import atman

                    # Only the context is ranked: the other prompt tokens are not suppressed (NaN).
                    rows = atman.relevance(model, prompt, generated, tokens=range(*self.alignment.context_tokens))
                    rows = rows.double().numpy()
            save_rows(runner.records, self.generation_key, kind, rows, generated.numpy(), cost)
            runner.counts.rows_computed += 1
            self._model_rows[kind] = rows, cost
        return self._model_rows[kind]


class Runner:
    def __init__(self, model, tokenizer, methods: list[Method], results: Results, settings: EvalSettings,
                 progress: bool = True):
        self.faithfulness_indices: set[int] = set()
        self.cost_indices: dict[str, set[int]] = {}
        self._warm: set[str] = set()
        self.model, self.tokenizer, self.methods = model, tokenizer, methods
        self.results, self.settings, self.progress = results, settings, progress
        # The rows besides softmax that the methods score (their records are made again where they lack them).
        self.attentions = tuple(sorted({m.macs.attention for m in methods if m.macs is not None} - {"softmax"}))
        self.records = records_dir(settings.records_root)
        self.counts = Counts()
        self.keys: dict[int, str] = {}

    @property
    def generations(self) -> int:
        return self.counts.generated

    def _bar(self, items, desc):
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, disable=not self.progress, mininterval=5.0, dynamic_ncols=True)

    def run(self, samples, shard: Shard = SINGLE_PROCESS) -> None:
        """Every sample (this rank's share of them under data parallelism: every shard.size-th one)."""
        self.keys = {s.index: sample_key(self.settings, s) for s in samples}
        if shard.leader:
            self.results.write({"kind": "run", "format": RESULTS_FORMAT, **self.settings.generation(),
                                "data": self.settings.data, "samples": [[i, k] for i, k in self.keys.items()],
                                "method_ranges": {m.name: list(m.indices) for m in self.methods if m.indices},
                                "method_skips": method_skips(self.methods, samples)})
        # A new stream must start with its run line (that is how a results stream is recognised).
        shard.barrier()
        # Faithfulness scores are kept for the samples phase 2 will reach: the first faithfulness_n with answers.
        answered = [s for s in samples
                    if s.answers and s.problem is None and s.index >= self.settings.faithfulness_from]
        self.faithfulness_indices = {s.index for s in answered[: self.settings.faithfulness_n]}
        # Each method's cost is measured on the first cost_n samples it scores (after-generation methods also
        # wherever their rows are computed anyway); plain generation on every one of the in-generation
        # methods' samples (the baseline on the same samples).
        self.cost_indices = {m.name: {s.index for s in [s for s in answered if m.scores_sample(s)]
                                      [: self.settings.cost_n]} for m in self.methods}
        self.cost_indices[GENERATION] = set().union(
            *(self.cost_indices[m.name] for m in self.methods if m.kind not in MODEL_METHODS))
        for sample in self._bar(shard.take(samples), "generate + AUC-PR"):
            self.score_sample(sample)
        faithful = [m for m in self.methods if m.faithfulness]
        chosen = shard.take([s for s in answered if s.index in self.faithfulness_indices])
        if faithful and chosen:
            for sample in self._bar(chosen, "faithfulness"):
                self.faithfulness_sample(sample, faithful)

    def _skip(self, sample, reason: str, **details) -> None:
        key = self.keys[sample.index]
        self.results.write({"kind": "skipped", "index": sample.index, "reason": reason, **details,
                            "key": key, "sample": key})

    def _prepare(self, sample) -> _Sample | None:
        from macs_kernels.apps.evaluation.alignment import align_qa, answer_step

        key = self.keys[sample.index]
        if self.results.get("skipped", sample.index, key=key) is not None:
            return None
        if sample.problem is not None:
            self._skip(sample, "answer_not_in_context", error=sample.problem)
            return None
        if not sample.answers:
            self._skip(sample, "no_gold_answer")
            return None
        try:
            alignment = align_qa(self.tokenizer, sample.question, sample.context)
        except ValueError as error:
            self._skip(sample, "alignment_failed", error=str(error))
            return None
        line = self.results.get("sample", sample.index, key=key)
        item = _Sample(self, sample, alignment, line)
        if line is not None:
            return item
        item.record()
        labels = alignment.answer_labels(sample.answers)
        generated = item.generated_ids.tolist()
        item.line = {
            "kind": "sample", "index": sample.index, "id": sample.id, "key": key, "sample": key,
            "generation": item.generation_key, "prompt_ids_sha1": ids_digest(alignment.input_ids),
            "n_input": len(alignment.input_ids), "context_tokens": list(alignment.context_tokens),
            "steps": len(generated), "generated_ids": generated,
            "generated": self.tokenizer.decode(generated, skip_special_tokens=True),
            "answer_step": answer_step(self.tokenizer, generated, [t for t, _ in sample.answers]),
            "n_answers": len(labels), "unmatched_answers": int(sum(not y.any() for y in labels)),
            "relocated_answers": len(sample.relocated),
            "efficient_residual_max": float(item.record().get("residual_max", 0.0)),
        }
        self.results.write(item.line)
        return item

    def _auc_key(self, sample, method: Method) -> str:
        return content_key({"sample": self.keys[sample.index], **method_identity(method)})

    def score_sample(self, sample) -> None:
        methods = [m for m in self.methods if m.scores_sample(sample)]
        todo = [m for m in methods
                if self.results.get("auc", sample.index, m.name, key=self._auc_key(sample, m)) is None]
        self.counts.auc_reused += len(methods) - len(todo)
        known = self.results.get("sample", sample.index, key=self.keys[sample.index])
        self.counts.samples_reused += known is not None
        if known is not None and not todo and not self._costs_todo(sample, known, methods):
            return
        item = self._prepare(sample)
        if item is None:
            return
        labels = item.alignment.answer_labels(sample.answers)
        faith = sample.index in self.faithfulness_indices
        for method in todo:
            scores = self._scores(method, item)
            line = score_auc(method, sample.index, scores, labels)
            line.update(key=self._auc_key(sample, method), sample=self.keys[sample.index])
            if faith and method.faithfulness:
                line["faithfulness_scores"] = scores["aggregate"].tolist()
            self.results.write(line)
            self.counts.auc_scored += 1
        for name in self._costs_todo(sample, item.line, methods):
            method = None if name == GENERATION else self._method(name)
            if method is not None and method.kind in MODEL_METHODS:
                cost, tokens = item.model_rows(method.kind)[1], item.line["steps"]
            else:
                measure = functools.partial(measure_in_generation, method, self.model, self.tokenizer, item.sample,
                                            item.prompt_ids, self.settings.max_new_tokens, self.settings.backend,
                                            item.line["steps"])
                if name not in self._warm:  # the first call of a path pays one-time setup: not the method's price
                    measure()
                    self._warm.add(name)
                cost, tokens = measure()
            self.results.write(cost_line(sample.index, name, self._cost_key(item.line["generation"], name),
                                         self.keys[sample.index], cost, tokens))

    def _cost_key(self, generation: str, name: str) -> str:
        identity = {"method": name} if name == GENERATION else method_identity(self._method(name))
        return content_key({"generation": generation, **identity, "cost_version": COST_VERSION})

    def _method(self, name: str) -> Method:
        return next(m for m in self.methods if m.name == name)

    def _costs_todo(self, sample, sample_line: dict, methods: list[Method]) -> list[str]:
        """The methods whose cost line this sample lacks: those whose cost set holds it (and plain generation's),
        and an after-generation method wherever its rows are in the record cache (measured when computed)."""
        names = [m.name for m in methods if sample.index in self.cost_indices[m.name]
                 or (m.kind in MODEL_METHODS and has_rows(self.records, sample_line["generation"], m.kind))]
        if sample.index in self.cost_indices.get(GENERATION, ()):
            names.append(GENERATION)
        return [name for name in names if self.results.get(
            "cost", sample.index, name, key=self._cost_key(sample_line["generation"], name)) is None]

    def _scores(self, method: Method, item: _Sample) -> dict:
        from macs_kernels.api.generation import eos_ids

        line = item.line
        ended = line["generated_ids"][-1] in eos_ids(self.model, self.tokenizer)
        return method_scores(
            method, item.sample.index, item.record() if method.needs_record else None,
            item.model_rows(method.kind)[0] if method.kind in MODEL_METHODS else None, line["steps"], line["n_input"],
            tuple(line["context_tokens"]), max(line["steps"] - ended, 1),
        )

    def faithfulness_sample(self, sample, methods: list[Method]) -> None:
        from macs_kernels.apps.evaluation.faithfulness import faithfulness_curves

        sample_line = self.results.get("sample", sample.index, key=self.keys[sample.index])
        if sample_line is None:  # skipped
            return
        key = self.keys[sample.index]
        todo = []
        for method in (m for m in methods if m.scores_sample(sample)):
            line = self.results.get("faithfulness", sample.index, method.name,
                                    key=self._faithfulness_key(sample_line, method))
            if line is None:
                todo.append(method)
                continue
            if line.get("sample") != key:  # same generation and method, other gold answers: still valid
                self.results.write({**line, "sample": key})
            self.counts.faithfulness_reused += 1
        if not todo:
            return
        item = self._prepare(sample)
        line = item.line
        context = tuple(line["context_tokens"])
        for method in todo:
            auc_line = self.results.get("auc", sample.index, method.name, key=self._auc_key(sample, method))
            scores = None
            if method.kind != "random":
                if auc_line is not None and "faithfulness_scores" in auc_line:
                    scores = np.asarray(auc_line["faithfulness_scores"])
                else:
                    scores = self._scores(method, item)["aggregate"]
            curves = faithfulness_curves(
                self.model, self.tokenizer, item.prompt_ids[None], item.generated_ids[None], context, scores,
                max_new_tokens=self.settings.max_new_tokens,
                rng=np.random.default_rng([RANDOM_SEED, sample.index, 1]),
            )
            self.results.write({
                "kind": "faithfulness", "index": sample.index, "method": method.name,
                "key": self._faithfulness_key(line, method), "sample": key,
                "srg": {name: curves["srg"][metric] for name, metric in FAITHFULNESS_METRICS.items()},
                "auc": curves["auc"], "curves": curves["curves"],
            })
            self.counts.faithfulness_computed += 1

    def _faithfulness_key(self, sample_line: dict, method: Method) -> str:
        # The masking curves depend on the generation and the method's scores, not on the gold answers.
        return content_key({"generation": sample_line["generation"], "index": sample_line["index"],
                            **method_identity(method)})


def run_eval(model, tokenizer, samples, methods: list[Method], settings: EvalSettings, out, progress=True,
             shard: Shard = SINGLE_PROCESS) -> Runner:
    """Generate, score and write every sample's results to `out` (reusing what is already there); under data
    parallelism, this rank's share of the samples."""
    runner = Runner(model, tokenizer, methods, Results(out), settings, progress)
    runner.run(samples, shard)
    return runner
