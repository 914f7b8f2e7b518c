"""The evaluation loop: one generation per sample, every method scored from it, results in a resumable JSONL.

Each line of the results file is one JSON object keyed by (kind, index[, method]); a later line with the
same key wins and a truncated last line (a killed run) is ignored, so a run can stop anywhere and resume.
Kinds: "run" (model and settings; a resumed run must match them), "sample" (the generation and the
alignment), "skipped" (a sample that cannot be scored, with the reason), "auc" (one method's AUC-PR of one
sample), "faithfulness" (one method's masking curves of one sample).

Phase 1 generates and scores every sample with every method; phase 2 runs the faithfulness curves (the
bulk of the time: 11 masked regenerations per method and sample) on the first --faithfulness-n samples
from index --faithfulness-from on.
Each generation's rows are kept as a compact record (float16 rows, float32 masses) in a cache folder, so a
method added later (another MACS ablation, efficient attention, AT2) is scored without regenerating.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..config import MacsConfig
from .metrics import auc_pr_sample, count_ties, paper_form_zscores

RANDOM_SEED = 20250921
# AT2's coefficients are trained on stqa_350's questions 0-249: it is scored on the others only.
AT2_FIRST_EVAL_INDEX = 250
FAITHFULNESS_METHODS = ("macs", "at2", "attention-mean", "random")
FAITHFULNESS_METRICS = {"perplexity": "perplexity", "rouge_l": "rouge_l", "logit": "mean_logit"}
_MACS_OPTIONS = {"alpha": "alpha", "pool": "pooling", "redistribute": "redistribute", "attention": "attention"}
BASE_METHODS = ("macs", "at2", "attention-mean", "rollout", "random")


class MethodUnavailable(ValueError):
    """A method that is recognised but cannot run in this installation."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One attribution method. name is canonical: "macs" plus only its non-default options."""

    name: str
    kind: str
    macs: MacsConfig | None = None

    @property
    def needs_record(self) -> bool:
        return self.kind in ("macs", "attention-mean", "at2")

    @property
    def faithfulness(self) -> bool:
        return self.name in FAITHFULNESS_METHODS


def parse_method(text: str) -> Method:
    """'macs', 'macs:pool=mean', 'macs:alpha=1:redistribute=off', 'attention-mean', 'rollout', 'random', 'at2'."""
    kind, _, options = text.strip().partition(":")
    if kind not in BASE_METHODS:
        raise ValueError(f"unknown method {text!r}; choose from {BASE_METHODS} (macs takes :key=value options)")
    if kind != "macs":
        if options:
            raise ValueError(f"method {kind!r} takes no options, got {text!r}")
        if kind == "at2":
            _check_at2()
        return Method(kind, kind)
    values = {}
    for option in filter(None, options.split(":")):
        key, eq, value = option.partition("=")
        if not eq or key not in _MACS_OPTIONS:
            raise ValueError(f"bad MACS option {option!r} in {text!r}; use {'|'.join(_MACS_OPTIONS)}=VALUE")
        if key == "alpha":
            try:
                values["alpha"] = float(value)
            except ValueError:
                raise ValueError(f"alpha must be a number, got {value!r}") from None
        elif key == "redistribute":
            if value not in ("on", "off"):
                raise ValueError(f"redistribute is on or off, got {value!r}")
            values["redistribute"] = value == "on"
        else:
            values[_MACS_OPTIONS[key]] = value
    config = MacsConfig(**values)
    default = MacsConfig()
    parts = []
    if config.alpha != default.alpha:
        parts.append(f"alpha={float(config.alpha)!r}")
    if config.pooling != default.pooling:
        parts.append(f"pool={config.pooling}")
    if config.redistribute != default.redistribute:
        parts.append(f"redistribute={'on' if config.redistribute else 'off'}")
    if config.attention != default.attention:
        parts.append(f"attention={config.attention}")
    return Method(":".join(["macs", *parts]), "macs", config)


def _check_at2() -> None:
    from ..at2 import DEFAULT_COEFFICIENTS

    if not DEFAULT_COEFFICIENTS.is_file():
        raise MethodUnavailable(f"at2 is not available yet: no trained coefficients at {DEFAULT_COEFFICIENTS}")


def at2_theta() -> np.ndarray:
    """The packaged AT2 coefficients (L, H) as float64."""
    from ..at2 import DEFAULT_COEFFICIENTS, load_coefficients

    return load_coefficients(DEFAULT_COEFFICIENTS)[0].double().numpy()


def at2_from_record(record: dict, theta: np.ndarray, response_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """AT2 token scores from the recorded rows: (per step (steps, N), aggregate (N,)).

    Step k's row is the query that predicts response token k, so theta . rows[k] is AT2's score with
    target token k alone; the aggregate averages the first `response_steps` rows (AT2's target: the
    response without its end-of-sequence token), as AT2Attributor.explain(sources="token") does.
    """
    rows = np.asarray(record["rows"], dtype=np.float64)
    if theta.shape != rows.shape[1:3]:
        raise ValueError(f"AT2 coefficients {theta.shape} do not match the record's (layers, heads) {rows.shape[1:3]}")
    per_step = np.einsum("slhn,lh->sn", rows, theta)
    return per_step, per_step[:response_steps].mean(0)


def default_methods() -> list[str]:
    """Every method this installation can run: the paper's MACS ablations and the baselines."""
    names = ["macs", "macs:pool=mean", "macs:pool=min", "macs:alpha=0.2", "macs:alpha=0.5", "macs:alpha=1.0",
             "macs:redistribute=off", "macs:attention=efficient", "at2", "attention-mean", "rollout", "random"]
    available = []
    for name in names:
        try:
            parse_method(name)
        except MethodUnavailable:
            continue
        available.append(name)
    return available


def parse_methods(text: str | None) -> list[Method]:
    methods = [parse_method(t) for t in (text.split(",") if text else default_methods()) if t.strip()]
    names = [m.name for m in methods]
    if not methods or len(set(names)) != len(names):
        raise ValueError(f"give one or more distinct methods, got {names}")
    return methods


# ---- the results file ---------------------------------------------------------------------------------
def line_key(line: dict) -> tuple:
    return (line["kind"], line.get("index"), line.get("method"))


def read_results(path: str | os.PathLike) -> dict[tuple, dict]:
    """The results file's lines by key (later lines win; unparsable lines from a killed write are skipped)."""
    lines: dict[tuple, dict] = {}
    path = Path(path)
    if not path.is_file():
        return lines
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            lines[line_key(line)] = line
    return lines


class Results:
    """The JSONL results file, appended line by line and indexed by key."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lines = read_results(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as f:  # a killed write can leave a line without its newline
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    with open(self.path, "a", encoding="utf-8") as g:
                        g.write("\n")

    def get(self, kind: str, index=None, method=None):
        return self.lines.get((kind, index, method))

    def write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.lines[line_key(line)] = line


# ---- records cache ------------------------------------------------------------------------------------
def records_dir(root, settings: dict) -> Path:
    """A folder per (model, dtype, max_new_tokens): records of different settings never mix."""
    if root is None:
        from ..models import cache_dir

        root = cache_dir() / "eval_records"
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(root) / digest


def save_record(folder: Path, index: int, record: dict, prompt_ids, generated_ids) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: (v.astype(np.float16) if k.endswith("rows") else v) for k, v in record.items()}
    tmp = folder / f".{index}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, prompt_ids=np.asarray(prompt_ids), generated_ids=np.asarray(generated_ids), **arrays)
    tmp.rename(folder / f"{index}.npz")


def load_record(folder: Path, index: int, prompt_ids, generated_ids) -> dict | None:
    """The cached record of sample `index`, or None when missing or made from other ids."""
    path = folder / f"{index}.npz"
    if not path.is_file():
        return None
    with np.load(path) as data:
        if not (np.array_equal(data["prompt_ids"], prompt_ids) and np.array_equal(data["generated_ids"], generated_ids)):
            return None
        return {k: data[k] for k in data.files if k not in ("prompt_ids", "generated_ids")}


# ---- scoring ------------------------------------------------------------------------------------------
def _zscores(log_c: np.ndarray) -> np.ndarray:
    """Row-wise z-scores of c = exp(log c), shifted by the row maximum (zeros where the spread is 0)."""
    top = np.max(log_c, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        c = np.where(np.isfinite(top), np.exp(log_c - np.where(np.isfinite(top), top, 0)), 0.0)
    std = c.std(axis=-1, keepdims=True)
    return np.where(std > 0, (c - c.mean(axis=-1, keepdims=True)) / np.where(std > 0, std, 1), 0.0)


def method_scores(method: Method, index: int, record, rollout, steps: int, n_input: int, context,
                  response_steps: int | None = None) -> dict:
    """{"rank": (steps, n_context) scores to rank by, "aggregate": (n_context,), "paper_form": (steps, n_context)}.

    MACS ranks by log c (the z-score is monotone in c, and log c keeps apart what c = exp(log c) rounds
    together); its aggregate row is the mean of the step z-scores, as Explanation.scores. "paper_form" is
    the score as the paper computes it, whose ties are counted. response_steps: the steps before an
    end-of-sequence token (AT2's aggregate target; default all).
    """
    response_steps = steps if response_steps is None else response_steps
    start, stop = context
    if method.kind == "macs":
        log_c = record_log_c(record, method)
        rank = np.maximum(log_c, np.finfo(np.float64).min)[:, start:stop]
        return {"rank": rank, "aggregate": _zscores(log_c).mean(0)[start:stop],
                "paper_form": paper_form_zscores(log_c)[:, start:stop]}
    if method.kind == "attention-mean":
        from .record import attention_mean_from_record

        full = attention_mean_from_record(record)
    elif method.kind == "at2":
        per_step, aggregate = at2_from_record(record, at2_theta(), response_steps)
        return {"rank": per_step[:, start:stop], "aggregate": aggregate[start:stop],
                "paper_form": per_step[:, start:stop].astype(np.float32)}
    elif method.kind == "rollout":
        full = rollout
    elif method.kind == "random":
        full = np.random.default_rng([RANDOM_SEED, index, 0]).random((steps, n_input))
    else:
        raise MethodUnavailable(f"method {method.name!r} cannot be scored")
    rank = full[:, start:stop]
    return {"rank": rank, "aggregate": rank.mean(0), "paper_form": rank.astype(np.float32)}


def record_log_c(record, method: Method) -> np.ndarray:
    from .record import macs_from_record

    config = method.macs
    return macs_from_record(record, alpha=config.alpha, pooling=config.pooling, redistribute=config.redistribute,
                            attention=config.attention)


def score_auc(method: Method, index: int, scores: dict, labels) -> dict:
    result = auc_pr_sample(scores["rank"], labels, aggregate=scores["aggregate"])
    tied = [count_ties(row) for row in scores["paper_form"]]
    return {
        "kind": "auc", "index": index, "method": method.name,
        "best": result["best"], "best_step": result["best_step"], "step_mean": result["step_mean"],
        "aggregate": result["aggregate"], "per_step": result["per_step"],
        "ties": {"tied_tokens": int(sum(tied)), "rows": len(tied), "rows_with_ties": int(sum(t > 0 for t in tied))},
    }


# ---- the loop -----------------------------------------------------------------------------------------
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

    def run_line(self) -> dict:
        return {"kind": "run", "model": self.model_name, "dtype": self.dtype, "max_new_tokens": self.max_new_tokens,
                "data": self.data}


def _check_resume(results: Results, settings: EvalSettings) -> None:
    line = results.get("run")
    if line is None:
        results.write(settings.run_line())
        return
    for key in ("model", "dtype", "max_new_tokens"):
        if line[key] != settings.run_line()[key]:
            raise ValueError(
                f"{results.path} was written with {key}={line[key]!r}, this run has {settings.run_line()[key]!r}; "
                "use another --out"
            )


class _Sample:
    """One sample's generation: alignment, ids and (lazily) its record and rollout rows."""

    def __init__(self, runner: "Runner", sample, alignment, line: dict | None):
        self.runner, self.sample, self.alignment = runner, sample, alignment
        self.prompt_ids = torch.tensor(alignment.input_ids)
        self.line = line
        self._record = self._rollout = None
        self.generated_ids = None if line is None else torch.tensor(line["generated_ids"])

    def generate(self) -> None:
        from .record import generate_record

        runner = self.runner
        record, generated, _ = generate_record(
            runner.model, runner.tokenizer, self.prompt_ids, max_new_tokens=runner.settings.max_new_tokens,
            efficient=runner.efficient, backend=runner.settings.backend,
        )
        if self.generated_ids is not None and not torch.equal(generated, self.generated_ids):
            raise RuntimeError(f"sample {self.sample.index}: regenerating gave another answer than the results file")
        self.generated_ids, self._record = generated, record
        save_record(runner.records, self.sample.index, record, self.prompt_ids, generated)
        runner.generations += 1

    def record(self) -> dict:
        if self._record is None:
            self._record = load_record(self.runner.records, self.sample.index, self.prompt_ids, self.generated_ids)
        if self._record is None or (self.runner.efficient and "efficient_rows" not in self._record):
            self.generate()
        return self._record

    def rollout(self) -> np.ndarray:
        if self._rollout is None:
            from .record import rollout_rows

            self._rollout = rollout_rows(self.runner.model, self.prompt_ids, self.generated_ids)
        return self._rollout


class Runner:
    def __init__(self, model, tokenizer, methods: list[Method], results: Results, settings: EvalSettings,
                 progress: bool = True):
        self.faithfulness_indices: set[int] = set()
        self.model, self.tokenizer, self.methods = model, tokenizer, methods
        self.results, self.settings, self.progress = results, settings, progress
        self.efficient = any(m.macs is not None and m.macs.attention == "efficient" for m in methods)
        self.records = records_dir(settings.records_root, {k: v for k, v in settings.run_line().items() if k != "data"})
        self.generations = 0
        _check_resume(results, settings)

    def _bar(self, items, desc):
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, disable=not self.progress, mininterval=5.0, dynamic_ncols=True)

    def run(self, samples) -> None:
        # Faithfulness scores are kept for the samples phase 2 will reach: the first faithfulness_n with answers.
        answered = [s for s in samples if s.answers and s.index >= self.settings.faithfulness_from]
        self.faithfulness_indices = {s.index for s in answered[: self.settings.faithfulness_n]}
        for sample in self._bar(samples, "generate + AUC-PR"):
            self.score_sample(sample)
        faithful = [m for m in self.methods if m.faithfulness]
        chosen = [s for s in answered if s.index in self.faithfulness_indices]
        if faithful and chosen:
            for sample in self._bar(chosen, "faithfulness"):
                self.faithfulness_sample(sample, faithful)

    def _prepare(self, sample) -> _Sample | None:
        from .alignment import align_qa, answer_step

        if self.results.get("skipped", sample.index) is not None:
            return None
        if not sample.answers:
            self.results.write({"kind": "skipped", "index": sample.index, "reason": "no_gold_answer"})
            return None
        try:
            alignment = align_qa(self.tokenizer, sample.question, sample.context)
        except ValueError as error:
            self.results.write({"kind": "skipped", "index": sample.index, "reason": "alignment_failed",
                                "error": str(error)})
            return None
        line = self.results.get("sample", sample.index)
        if line is not None and line["prompt_ids_sha1"] != _sha1(alignment.input_ids):
            line = None  # another tokenizer or prompt: generate again
        item = _Sample(self, sample, alignment, line)
        if line is None:
            item.generate()
            labels = alignment.answer_labels(sample.answers)
            generated = item.generated_ids.tolist()
            item.line = {
                "kind": "sample", "index": sample.index, "id": sample.id,
                "prompt_ids_sha1": _sha1(alignment.input_ids), "n_input": len(alignment.input_ids),
                "context_tokens": list(alignment.context_tokens), "steps": len(generated),
                "generated_ids": generated,
                "generated": self.tokenizer.decode(generated, skip_special_tokens=True),
                "answer_step": answer_step(self.tokenizer, generated, [t for t, _ in sample.answers]),
                "n_answers": len(labels), "unmatched_answers": int(sum(not y.any() for y in labels)),
                "efficient_residual_max": float(item._record.get("residual_max", 0.0)),
            }
            self.results.write(item.line)
        return item

    def score_sample(self, sample) -> None:
        todo = [m for m in self.methods if self.results.get("auc", sample.index, m.name) is None]
        if not todo and self.results.get("sample", sample.index) is not None:
            return
        item = self._prepare(sample)
        if item is None:
            return
        labels = item.alignment.answer_labels(sample.answers)
        faith = sample.index in self.faithfulness_indices
        for method in todo:
            if method.kind == "at2" and sample.index < AT2_FIRST_EVAL_INDEX:
                continue
            scores = self._scores(method, item)
            line = score_auc(method, sample.index, scores, labels)
            if faith and method.faithfulness:
                line["faithfulness_scores"] = scores["aggregate"].tolist()
            self.results.write(line)

    def _scores(self, method: Method, item: _Sample) -> dict:
        from ..explanation import _eos_ids

        line = item.line
        ended = line["generated_ids"][-1] in _eos_ids(self.model, self.tokenizer)
        return method_scores(
            method, item.sample.index, item.record() if method.needs_record else None,
            item.rollout() if method.kind == "rollout" else None, line["steps"], line["n_input"],
            tuple(line["context_tokens"]), max(line["steps"] - ended, 1),
        )

    def faithfulness_sample(self, sample, methods: list[Method]) -> None:
        from .faithfulness import faithfulness_curves

        todo = [m for m in methods if self.results.get("faithfulness", sample.index, m.name) is None
                and not (m.kind == "at2" and sample.index < AT2_FIRST_EVAL_INDEX)]
        if not todo:
            return
        item = self._prepare(sample)
        if item is None:
            return
        line = item.line
        context = tuple(line["context_tokens"])
        for method in todo:
            auc_line = self.results.get("auc", sample.index, method.name)
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
                "srg": {name: curves["srg"][key] for name, key in FAITHFULNESS_METRICS.items()},
                "auc": curves["auc"], "curves": curves["curves"],
            })


def _sha1(ids) -> str:
    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def run_eval(model, tokenizer, samples, methods: list[Method], settings: EvalSettings, out, progress=True) -> Runner:
    """Generate, score and write every sample's results to `out` (resuming what is already there)."""
    runner = Runner(model, tokenizer, methods, Results(out), settings, progress)
    runner.run(samples)
    return runner
