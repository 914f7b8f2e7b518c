"""The attribution core that every engine feeds: per-pass accumulation (op choice, tensor-parallel head
pooling, floor and log, combine over layers, NaN check), per-sequence row storage keyed by (sequence, step),
and the score definitions. It knows nothing of transformers, vLLM or HTTP; engines (`tracing` for generate,
`continuous` for continuous batching, `vllm` for vLLM) translate their metadata into its row plans.
"""
from . import support
from .accumulate import DenseRows, Kernels, PackedRows, PagedRows, PassRows
from .rows import NAN_MESSAGE, RowStore
from .scores import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    SCORE_DEFINITION,
    RunningWholeAnswer,
    json_values,
    log_zscores,
    paper_zscores,
    whole_answer_scores,
)

__all__ = [
    "AGGREGATIONS", "DEFAULT_AGGREGATION", "NAN_MESSAGE", "SCORE_DEFINITION", "DenseRows", "Kernels", "PackedRows",
    "PagedRows", "PassRows", "RowStore", "RunningWholeAnswer", "json_values", "log_zscores", "paper_zscores", "support",
    "whole_answer_scores",
]
