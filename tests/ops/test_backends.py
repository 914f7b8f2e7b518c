"""Each backend is declared once (ops/backends.py, issue 49): the registry, the ops' option check, the command
line's --backend choices and the docs' backend table come from those declarations, and no code compares a backend's
name."""
from __future__ import annotations

import argparse
import ast
import sys
import types
from pathlib import Path

import pytest
import torch

from macs_kernels import ops
from macs_kernels.ops import backends, registry
from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.variant import Variant

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_backend_table_is_the_declarations():
    page = (ROOT / "docs" / "backends.md").read_text()
    table = page.split("<!-- backend table: begin -->\n")[1].split("<!-- backend table: end -->")[0]
    assert table == backends.markdown_table(), (
        "docs/backends.md's backend table differs from macs_kernels/ops/backends.py: replace it with the output of "
        "python -c \"from macs_kernels.ops import backends; print(backends.markdown_table(), end='')\"")
    assert [line.split("`")[1] for line in table.splitlines()[2:]] == list(backends.NAMES)


def test_the_command_line_choices_are_the_declarations():
    from macs_kernels.apps.bench import generate as bench
    from macs_kernels.apps.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("explain", "eval"):
        (option,) = [a for a in commands[command]._actions if "--backend" in a.option_strings]
        # Read when a value is given (argparse reads `choices` for --help, which would import torch).
        accepted = []
        for name in backends.NAMES:
            try:
                accepted.append(option.type(name))
            except argparse.ArgumentTypeError:
                pass
        assert tuple(accepted) == backends.ENGINE_BACKENDS, command
    assert bench.engine_backends() == backends.ENGINE_BACKENDS
    # The engines' backends are those that implement every op of the tracer: numba (the paged op only) is not one.
    assert backends.ENGINE_BACKENDS == tuple(
        b.name for b in backends.DECLARED if set(registry.TRACER_OPS) <= set(b.ops))
    assert "numba" in backends.NAMES and "numba" not in backends.ENGINE_BACKENDS
    with pytest.raises(SystemExit):
        commands["explain"].parse_args(["--backend", "numba"])
    assert isinstance(commands["explain"].parse_args(["--backend", "triton"]), argparse.Namespace)


def test_the_ops_accept_the_declared_names():
    assert ops.BACKENDS == backends.NAMES
    assert registry.VARIANT_BACKENDS == tuple(
        b.name for b in backends.DECLARED if set(backends.VARIANT_OPS) <= set(b.variant_ops))
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        registry.why_unavailable("nope", "cpu")


def test_no_code_compares_a_backend_name():
    """The registry and the row plans read declarations (and Kernels' declared capabilities), not names."""
    for path in (ROOT / "macs_kernels" / "ops" / "registry.py", ROOT / "macs_kernels" / "core" / "plans.py"):
        compared = [
            node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Compare)
            # a device type ("cuda", "cpu") is not a backend's name
            and not any(isinstance(side, ast.Attribute) and side.attr == "type"
                        for side in (node.left, *node.comparators))
            for value in (node.left, *node.comparators)
            if isinstance(value, ast.Constant) and value.value in backends.NAMES
        ]
        assert not compared, f"{path.name} compares backend names on lines {compared}"


@pytest.fixture
def declared_fake(monkeypatch):
    """A backend added by one declaration: its package's kernels are torch's, except a variant kernel of its own."""
    package = types.ModuleType("fake_backend")
    for op in ("macs_pool", "macs_update_rows", "macs_zscore", "macs_pool_paged", "decode_attention"):
        setattr(package, op, getattr(torch_backend, op))
    monkeypatch.setitem(sys.modules, "fake_backend", package)
    fake = backends.Backend(
        "fake", devices=("cpu",), ops=("macs_pool", "macs_update_rows", "macs_zscore", "macs_pool_paged",
                                       "decode_attention"),
        variant_ops=("macs_pool", "decode_attention"), module="fake_backend", requires="fake_backend",
        missing="fake is absent ({error})", device_reason="the fake backend runs on CPU tensors",
        summary="a test's",
    )
    monkeypatch.setitem(backends.BY_NAME, "fake", fake)
    return package


def test_a_backend_is_its_package_and_one_declaration(declared_fake):
    assert registry.why_unavailable("fake", "cpu", "macs_pool") is None
    assert registry.why_unavailable("fake", "meta") == "the fake backend runs on CPU tensors"
    assert "implements" in registry.why_unavailable("fake", "cpu", "efficient_attention")
    assert registry.implementation("fake", "macs_pool") is declared_fake.macs_pool
    # Its variant support is declared data: a variant op's kernel takes the variant, another's is refused before
    # work, naming the backend and the argument.
    assert registry.kernel("fake", "cpu", "decode_attention", Variant(softcap=2.0)) is declared_fake.decode_attention
    with pytest.raises(NotImplementedError, match=r"macs_pool_paged: the fake backend.*\(window given\)"):
        registry.kernel("fake", "cpu", "macs_pool_paged", Variant(window=2))
    kernels = registry.Kernels.of("fake")
    assert kernels.backend == "fake" and kernels.pool is declared_fake.macs_pool and not kernels.reference
    assert kernels.pool_dense is None and kernels.pool_dense_beams is None
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 6, 4)
    out = torch.zeros(1, 1, 3)
    ranges = (torch.tensor([[0]]), torch.tensor([[3]]), torch.tensor([[6]]))
    kernels.pool(q, k, out, *ranges, 0.5, "max", True, None)
    assert out.sum() > 0
