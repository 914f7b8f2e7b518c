"""The attribution core that every engine feeds: row plans over dense, packed and paged caches (plans), per-pass
accumulation (tensor-parallel head pooling, floor and log, combine over layers, NaN check), per-sequence row
storage keyed by (sequence, step), a serving request's life (requests: configure, admit, resume, finish,
release) and the registry of named scores (scores.SCORES). It knows nothing of transformers, vLLM or HTTP;
engines (`generate` for transformers' generate, `continuous` for continuous batching, `vllm` for vLLM) translate their
metadata into its row plans.
"""
