"""MACS under continuous batching needs transformers >= 5.19 (macs_kernels.engines.continuous.batching_config_class):
with an older ContinuousBatchingConfig (5.17's fields, as the GPU image has it) every entry point refuses, naming the
version, before any work; with none at all too."""
import dataclasses
import importlib
import sys
from types import SimpleNamespace

import pytest

from macs_kernels import explain
from macs_kernels.apps.serve import cli
from macs_kernels.apps.serve.engine import Engine
from macs_kernels.engines.continuous import attach_continuous, batching_config_class
from tests.helpers import NEEDS_CONTINUOUS_BATCHING, tiny_chat_model

REFUSAL = r"needs transformers>=5\.19; this is transformers 5\.17\.0"


@dataclasses.dataclass
class ConfigOf5_17:
    """transformers 5.17's ContinuousBatchingConfig, the fields the package would set (read from its wheel)."""
    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    use_async_batching: bool | None = None
    use_cuda_graph: bool | None = None


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    return folder, *tiny_chat_model(folder)


@pytest.fixture(params=["5.17 fields", "no such class"])
def old_transformers(request, monkeypatch, chat_model):
    # The modules as they are once the model and tokenizer exist (a first tokenizer load imports transformers anew).
    configuration_utils = importlib.import_module("transformers.generation.configuration_utils")
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.17.0")
    if request.param == "no such class":
        monkeypatch.delattr(configuration_utils, "ContinuousBatchingConfig")
    else:
        monkeypatch.setattr(configuration_utils, "ContinuousBatchingConfig", ConfigOf5_17)
    return chat_model


@NEEDS_CONTINUOUS_BATCHING
def test_the_installed_transformers_config_is_taken_as_it_is():
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    assert batching_config_class() is ContinuousBatchingConfig


def _no_work(*args, **kwargs):
    raise AssertionError("work began before the version was checked")


def test_explain_and_the_tracer_refuse_an_old_transformers_before_any_work(old_transformers, monkeypatch):
    _, model, tokenizer = old_transformers
    monkeypatch.setattr(type(model), "generate_batch", _no_work)
    monkeypatch.setattr(type(model), "init_continuous_batching", _no_work)
    monkeypatch.setattr(type(tokenizer), "__call__", _no_work)
    with pytest.raises(RuntimeError, match=REFUSAL):
        explain(model, tokenizer, ["Hi"], max_new_tokens=2, continuous_batching=True)
    with pytest.raises(RuntimeError, match=REFUSAL):
        with attach_continuous(model):
            pass
    assert "init_continuous_batching" not in vars(model)  # the tracer left the model as it was


def test_the_server_refuses_an_old_transformers_before_the_model_loads(old_transformers, monkeypatch):
    monkeypatch.setattr("macs_kernels.apps.cli.common.load_from_args", _no_work)
    args = SimpleNamespace(threads=None, model=str(old_transformers[0]), cache_tokens=256, page_size=16,
                           max_batch_tokens=64, default_max_tokens=8, at2_coefficients=None, max_body_bytes=None,
                           max_image_pixels=None, device=None, host="127.0.0.1", port=0, served_name=None)
    monkeypatch.setattr(cli, "check_arguments", lambda args: None)
    with pytest.raises(SystemExit, match="macs-kernels serve: .*" + REFUSAL):
        cli.run_serve(args)
    with pytest.raises(RuntimeError, match=REFUSAL):
        Engine(None, None, name="tiny")
