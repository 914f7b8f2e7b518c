"""Engines: where a model runs and its attention rows are taken (transformers' generate, continuous
batching, vLLM's internals); each translates its metadata into the core's row plans."""
