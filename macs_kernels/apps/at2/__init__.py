"""AT2 ("Learning to Attribute with Attention"): per-head coefficients theta (L, H) over attention features.

A source's score is sum over (layer, head) of theta[l, h] * (attention of the target rows on the source's
tokens, summed over its tokens and averaged over target tokens). The features come from the post-RoPE
queries captured during generation (or one forward) and the KV cache, through ops.attention_features,
each layer with its own softmax scale: no output_attentions, no (L, H, T, N) tensor.

Modules: attributor (AT2Attributor, AT2Explanation), coefficients (files and the model they were trained
for), features (query capture), sources (tokens, words, sentences), train (ablations and the fit).
"""
from __future__ import annotations

from macs_kernels.apps.at2.attributor import AT2Attributor, AT2Explanation
from macs_kernels.apps.at2.coefficients import (
    DEFAULT_COEFFICIENTS,
    load_coefficients,
    model_record,
    model_shape,
    save_coefficients,
)
from macs_kernels.apps.at2.sources import SOURCE_TYPES, Source, make_sources
from macs_kernels.apps.at2.train import train_coefficients

__all__ = [
    "DEFAULT_COEFFICIENTS",
    "SOURCE_TYPES",
    "AT2Attributor",
    "AT2Explanation",
    "Source",
    "load_coefficients",
    "make_sources",
    "model_record",
    "model_shape",
    "save_coefficients",
    "train_coefficients",
]
