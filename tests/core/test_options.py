"""One options type (issue 49): MacsConfig is the only list of MACS's option names, every engine's per-request
names are read from it, and the default alpha is one named value that every signature uses."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import macs_kernels
from macs_kernels.core import config as core_config
from macs_kernels.core.config import DEFAULT_ALPHA, MacsConfig, config_of, option_names

PACKAGE = Path(macs_kernels.__file__).parent


def test_every_engines_option_names_are_read_from_macs_config():
    from macs_kernels.apps.evaluation.methods import _MACS_OPTIONS
    from macs_kernels.engines.continuous import _PER_REQUEST_FIELDS
    from macs_kernels.engines.vllm.tracer import OPTIONS

    assert option_names() == tuple(field.name for field in dataclasses.fields(MacsConfig))
    assert _PER_REQUEST_FIELDS == ("alpha", "pooling", "redistribute", "attention", "fused_decode")
    assert _PER_REQUEST_FIELDS == option_names("rows", "pass")
    assert OPTIONS == ("alpha", "pooling", "redistribute", "attention") == option_names("rows")
    assert tuple(_MACS_OPTIONS.values()) == option_names("rows") and "pool" in _MACS_OPTIONS
    with pytest.raises(ValueError, match="unknown option kinds"):
        option_names("request")


def test_the_default_alpha_is_written_once_per_layer_and_every_signature_uses_it():
    from macs_kernels import ops
    from macs_kernels.api.explanation import explain, stream
    from macs_kernels.apps.evaluation.record import macs_from_record
    from macs_kernels.ops import _checks, reference

    assert _checks.DEFAULT_ALPHA == DEFAULT_ALPHA == MacsConfig().alpha
    for function in (explain, stream, macs_from_record, ops.decode_attention, ops.macs_update, ops.macs_update_rows,
                     reference.layer_log_term_reference, reference.macs_step_reference,
                     reference.macs_update_rows_reference, reference.macs_update_reference):
        assert inspect.signature(function).parameters["alpha"].default == DEFAULT_ALPHA, function.__name__
    # No other literal default: a parameter, field or keyword named alpha defaults to a name, never a number.
    literal = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                positional = [*arguments.posonlyargs, *arguments.args]
                pairs = [*zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults),
                         *zip(arguments.kwonlyargs, arguments.kw_defaults)]
                literal += [f"{path.name}:{node.lineno}" for arg, default in pairs
                            if arg.arg == "alpha" and isinstance(default, ast.Constant) and default.value is not None]
            elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "alpha"
                  and isinstance(node.value, ast.Call) and node.value.args
                  and isinstance(node.value.args[0], ast.Constant)):
                literal.append(f"{path.name}:{node.lineno}")
    assert not literal, f"alpha defaults written as numbers: {literal}"


def test_an_entry_point_passes_the_object_on():
    config = MacsConfig(alpha=0.5)
    assert config_of(config, {}) is config
    assert config_of(None, {"alpha": 0.5}) == config
    with pytest.raises(TypeError, match="not both"):
        config_of(config, {"alpha": 0.5})
    with pytest.raises(TypeError, match="must be a MacsConfig"):
        config_of({"alpha": 0.5}, {})
    assert core_config.OPTION_KINDS == ("rows", "pass", "engine")


@pytest.mark.parametrize("attention", ["efficient", "norm"])
def test_fused_decode_is_refused_for_rows_that_never_fuse(attention):
    """Efficient and norm rows need the attention output first: fused_decode=True with them would be accepted and
    ignored (the server reported it back as if it had run), so every entry point's config refuses it."""
    with pytest.raises(ValueError, match=f"fused_decode=True fuses softmax rows only; attention='{attention}'"):
        MacsConfig(attention=attention, fused_decode=True)
    assert MacsConfig(attention=attention, fused_decode=False).fused_decode is False
    assert MacsConfig(attention="softmax", fused_decode=True).fused_decode is True
    pydantic = pytest.importorskip("pydantic")
    from macs_kernels.apps.serve.schemas import AttributionOptions

    with pytest.raises(pydantic.ValidationError, match="fused_decode=True fuses softmax rows only"):
        AttributionOptions(attention=attention, fused_decode=True)
