"""The attribution core that every engine feeds: row plans over dense, packed and paged caches (plans), per-pass
accumulation (tensor-parallel head pooling, floor and log, combine over layers, NaN check), per-sequence row
storage keyed by (sequence, step), a serving request's life (requests: configure, admit, resume, finish,
release) and the registry of named scores (scores.SCORES). It knows nothing of transformers, vLLM or HTTP;
engines (`tracing` for generate, `continuous` for continuous batching, `vllm` for vLLM) translate their metadata
into its row plans.
"""
from ..ops.registry import Kernels
from . import support
from .accumulate import PassRows
from .plans import DenseRows, PackedRows, PagedRows, RowPlan
from .rows import NAN_MESSAGE, RowStore
from .scores import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    SCORE_DEFINITION,
    SCORES,
    RunningWholeAnswer,
    Score,
    json_values,
    log_zscores,
    paper_zscores,
    step_scores,
    whole_answer_scores,
)

__all__ = [
    "AGGREGATIONS", "DEFAULT_AGGREGATION", "NAN_MESSAGE", "SCORE_DEFINITION", "DenseRows", "Kernels", "PackedRows",
    "PagedRows", "PassRows", "RowPlan", "RowStore", "RunningWholeAnswer", "SCORES", "Score", "json_values",
    "log_zscores", "paper_zscores", "step_scores", "support", "whole_answer_scores",
]
