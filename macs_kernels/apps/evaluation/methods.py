"""The attribution methods an evaluation compares, by name: "macs" with its ablation options, the baselines, AT2."""
from __future__ import annotations

import dataclasses
import functools

from macs_kernels.core.config import MacsConfig, option_names

BASE_METHODS = ("macs", "at2", "attention-mean", "rollout", "random", "attnlrp", "atman")
# Methods computed from the model after the generation (not from the recorded attention rows).
MODEL_METHODS = ("rollout", "attnlrp", "atman")
FAITHFULNESS_METHODS = ("macs", "at2", "attention-mean", "random", "attnlrp", "atman")
# Faithfulness metrics: name in the results -> name in faithfulness_curves' output.
FAITHFULNESS_METRICS = {"perplexity": "perplexity", "rouge_l": "rouge_l", "logit": "mean_logit"}
# Why AT2 is not scored on a question: its coefficient file records the questions it was trained on.
AT2_TRAINED_ON = "AT2's coefficients were trained on these questions"
# A method's spelling of the options that change the rows ("macs:pool=mean": pooling is spelt pool).
_MACS_OPTIONS = {{"pooling": "pool"}.get(name, name): name for name in option_names("rows")}
# attnlrp (a backward pass per step) and atman (a forward per context token) are opt-in: they would multiply
# the cost of a default run.
DEFAULT_METHODS = ("macs", "macs:pool=mean", "macs:pool=min", "macs:alpha=0.2", "macs:alpha=0.5", "macs:alpha=1.0",
                   "macs:redistribute=off", "macs:attention=efficient", "macs:attention=norm", "at2", "attention-mean",
                   "rollout", "random")
# The paper's Table 2: every method above plus the expensive ones (run them on a subset: --method-range).
ALL_METHODS = (*DEFAULT_METHODS, "attnlrp", "atman")


class MethodUnavailable(ValueError):
    """A method that is recognised but cannot run in this installation."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One attribution method. name is canonical: "macs" plus only its non-default options."""

    name: str
    kind: str
    macs: MacsConfig | None = None
    # [start, stop) of the sample indices this method is scored on (--method-range); None: every sample.
    # Not part of its identity: a sample's scores do not depend on which other samples are scored.
    indices: tuple[int, int] | None = dataclasses.field(default=None, compare=False)

    @property
    def needs_record(self) -> bool:
        return self.kind in ("macs", "attention-mean", "at2")

    @property
    def faithfulness(self) -> bool:
        return self.name in FAITHFULNESS_METHODS

    def skip_reason(self, sample) -> str | None:
        """Why this method is not scored on `sample` (a QASample), or None when it is: outside its
        --method-range, or AT2 on a question its coefficients were trained on (by content, in any file)."""
        if self.indices is not None and not self.indices[0] <= sample.index < self.indices[1]:
            return f"outside --method-range {self.indices[0]}:{self.indices[1]}"
        if self.kind == "at2" and _at2_trained_on(sample):
            return AT2_TRAINED_ON
        return None

    def scores_sample(self, sample) -> bool:
        return self.skip_reason(sample) is None


def method_skips(methods, samples) -> dict[str, dict[str, list[int]]]:
    """{method name: {reason: sample indices}} of the samples each method is not scored on (skip_reason)."""
    skips: dict[str, dict[str, list[int]]] = {}
    for method in methods:
        for sample in samples:
            reason = method.skip_reason(sample)
            if reason is not None:
                skips.setdefault(method.name, {}).setdefault(reason, []).append(sample.index)
    return skips


def parse_method(text: str) -> Method:
    """'macs', 'macs:pool=mean', 'macs:alpha=1:redistribute=off', 'attention-mean', 'rollout', 'random', 'at2',
    'attnlrp', 'atman'."""
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
    from macs_kernels.apps.at2 import DEFAULT_COEFFICIENTS

    if not DEFAULT_COEFFICIENTS.is_file():
        raise MethodUnavailable(f"at2 is not available yet: no trained coefficients at {DEFAULT_COEFFICIENTS}")
    if _at2_training_questions(DEFAULT_COEFFICIENTS) is None:
        raise MethodUnavailable(f"at2 cannot be evaluated: {DEFAULT_COEFFICIENTS} does not record the questions it "
                                "was trained on, so they cannot be held out (train it again with `macs-kernels at2 "
                                "train`, which records them)")


@functools.cache
def _at2_training_questions(path) -> frozenset[str] | None:
    from macs_kernels.apps.at2.coefficients import load_coefficients, training_questions

    return training_questions(load_coefficients(path)[1])


def _at2_trained_on(sample) -> bool:
    from macs_kernels.apps.at2 import DEFAULT_COEFFICIENTS
    from macs_kernels.apps.at2.coefficients import question_digest

    return question_digest(sample.question, sample.context) in _at2_training_questions(DEFAULT_COEFFICIENTS)


def default_methods() -> list[str]:
    """Every method this installation can run: the paper's MACS ablations and the baselines."""
    available = []
    for name in DEFAULT_METHODS:
        try:
            parse_method(name)
        except MethodUnavailable:
            continue
        available.append(name)
    return available


def parse_methods(text: str | None, ranges: dict[str, tuple[int, int]] | None = None) -> list[Method]:
    """Methods from a comma-separated list ("all": the paper's Table 2, ALL_METHODS; default:
    default_methods()); ranges: method name -> [start, stop) of the sample indices it is scored on."""
    if text and text.strip() == "all":
        text = ",".join(ALL_METHODS)
    methods = [parse_method(t) for t in (text.split(",") if text else default_methods()) if t.strip()]
    names = [m.name for m in methods]
    if not methods or len(set(names)) != len(names):
        raise ValueError(f"give one or more distinct methods, got {names}")
    canonical = {}
    for name, span in (ranges or {}).items():
        method = parse_method(name).name
        if method not in names:
            raise ValueError(f"--method-range names {name!r}, which is not among the methods {names}")
        canonical[method] = span
    return [dataclasses.replace(m, indices=canonical[m.name]) if m.name in canonical else m for m in methods]


def parse_method_ranges(texts) -> dict[str, tuple[int, int]]:
    """["attnlrp=250:270", "atman=250:270"] -> {"attnlrp": (250, 270), ...} (--method-range)."""
    ranges = {}
    for text in texts or ():
        name, eq, span = text.rpartition("=")  # a MACS method name holds "=" too
        start, colon, stop = span.partition(":")
        if not eq or not colon or not start.strip().isdigit() or not stop.strip().isdigit():
            raise ValueError(f"--method-range {text!r}: use METHOD=START:STOP, e.g. attnlrp=250:270")
        if int(start) >= int(stop):
            raise ValueError(f"--method-range {text!r}: START must be below STOP")
        if name.strip() in ranges:
            raise ValueError(f"--method-range names {name.strip()!r} twice")
        ranges[name.strip()] = (int(start), int(stop))
    return ranges
