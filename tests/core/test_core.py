"""The attribution core: the row store every engine writes, the pass accumulator's floor, log and NaN check,
the row plans (one protocol over dense, packed and paged caches; paged rows over vLLM's and FLASH_ATTN's KV
layouts), and the package's layering (no import cycle; each layer
imports only the layers below it)."""
import ast
import math
import pathlib
import threading

import pytest
import torch

from macs_kernels.core.accumulate import PassRows
from macs_kernels.core.config import MacsConfig
from macs_kernels.core.plans import DenseRows, PackedRows, PagedRows
from macs_kernels.core.rows import NAN_MESSAGE, RowStore
from macs_kernels.core.scores import log_zscores, paper_zscores
from macs_kernels.engines.vllm.tracer import key_pages
from macs_kernels.ops import macs_pool
from macs_kernels.ops.registry import Kernels
from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.torch.backend import log_floor
from macs_kernels.ops.torch.packed import Segments
from macs_kernels.ops.variant import Variant

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "macs_kernels"


def test_rows_are_keyed_by_step_and_a_restart_resumes_them():
    store = RowStore()
    store.open("a", 3, config="options")
    store.put([("a", 0, torch.tensor([1.0, 2.0, 3.0, 99.0])), ("a", 1, torch.tensor([4.0, 5.0, 6.0]))])
    store.finish("a")  # the engine finished the old state of a request it re-queues
    store.open("a", 3, step=2)
    store.put([("a", 2, torch.tensor([7.0, 8.0, 9.0]))])
    assert torch.equal(store.rows("a"), torch.arange(1.0, 10.0).view(3, 3))
    assert store.config("a") == "options"
    store.put([("a", 1, torch.tensor([0.0, 0.0, 0.0]))])  # a row computed again replaces the earlier one
    assert store.rows("a")[1].tolist() == [0.0, 0.0, 0.0] and store.count("a") == 3
    with pytest.raises(RuntimeError, match="resumes at step 5"):
        store.open("a", 3, step=5)
    with pytest.raises(RuntimeError, match="row 4 arrived before row 3"):
        store.put([("a", 4, torch.zeros(3))])
    store.open("a", 2)  # an id reused for a new sequence starts over
    assert store.rows("a").shape == (0, 2)


def test_a_cursor_reads_only_new_rows_while_rows_grow_past_their_first_allocation():
    store = RowStore()
    store.open("s", 2)
    cursor, seen = 0, []
    for step in range(20):
        store.put([("s", step, torch.full((2,), float(step)))])
        new, cursor = store.read("s", cursor)
        assert new.shape == (1, 2) and cursor == step + 1
        seen.append(new)
    assert torch.equal(torch.cat(seen), store.rows("s"))
    assert store.read("s", cursor)[0].shape == (0, 2)


def test_finished_sequences_are_bounded_and_released_ones_say_so():
    store = RowStore(keep_finished=2)
    for key in "abc":
        store.open(key, 1)
        store.put([(key, 0, torch.zeros(1))])
        store.finish(key)
    with pytest.raises(KeyError, match="keep_finished=2"):
        store.rows("a")
    assert store.rows("c").shape == (1, 1)
    store.release("c")
    with pytest.raises(KeyError, match="released"):
        store.rows("c")
    with pytest.raises(KeyError, match="no MACS rows"):
        store.rows("never")
    with pytest.raises(ValueError, match="keep_finished"):
        RowStore(keep_finished=-1)


def test_running_sums_average_over_steps_and_go_with_the_rows():
    store = RowStore()
    store.open("f", 2)
    for step in range(3):
        store.add("f", "at2", torch.full((2, 3), float(step)))
    torch.testing.assert_close(store.mean("f", "at2"), torch.full((2, 3), 1.0))
    with pytest.raises(KeyError, match="no other"):
        store.mean("f", "other")
    store.release("f")
    with pytest.raises(KeyError, match="released"):
        store.mean("f", "at2")


def test_rows_of_a_sequence_released_mid_pass_are_discarded_but_unknown_keys_raise():
    store = RowStore()
    store.open("c", 2)
    store.release("c")  # a client left while the engine was in the middle of the pass that scores "c"
    store.put([("c", 0, torch.ones(2))])
    store.add("c", "at2", torch.ones(2))
    with pytest.raises(KeyError, match="released"):
        store.rows("c")
    with pytest.raises(KeyError, match="no MACS rows"):
        store.put([("never", 0, torch.ones(2))])


def test_a_nan_row_fails_its_sequence_only():
    store = RowStore()
    for key in ("bad", "good"):
        store.open(key, 2)
    store.put([("bad", 0, None), ("good", 0, torch.ones(2))])
    with pytest.raises(FloatingPointError, match="NaN in an attention row"):
        store.rows("bad")
    assert store.rows("good").tolist() == [[1.0, 1.0]]


def test_concurrent_writer_and_readers_see_whole_rows():
    store = RowStore()
    store.open("t", 64)
    done = threading.Event()
    problems = []

    def read():
        cursor = 0
        while not done.is_set() or cursor < 200:
            new, cursor = store.read("t", cursor)
            problems.extend(row for row in new if not bool((row == row[0]).all()))

    readers = [threading.Thread(target=read) for _ in range(3)]
    for reader in readers:
        reader.start()
    for step in range(200):
        store.put([("t", step, torch.full((64,), float(step)))])
    done.set()
    for reader in readers:
        reader.join()
    assert not problems


def test_pass_rows_floor_log_and_combine_once_with_per_row_alpha():
    generator = torch.Generator().manual_seed(0)
    rows = PassRows(num_layers=3, shape=(2,), n_max=4, device="cpu", shards=None)
    rows.pooled.copy_(torch.rand(3, 2, 4, generator=generator))
    expected = rows.pooled.clone()
    alpha = torch.tensor([0.8, 0.5])
    log_c, broken = rows.finish(alpha, ["max", "mean"], torch.tensor([4, 3]))
    for r, a in enumerate(alpha.tolist()):
        want = torch.log(a * expected[:, r] + 1 - a).sum(dim=0)
        want[3 if r == 1 else 4:] = 0.0
        torch.testing.assert_close(log_c[r], want)
    assert not broken.any()
    rows.pooled.fill_(0.5)
    rows.pooled[1, 0, 2] = float("nan")
    rows.pooled[1, 1, 3] = float("nan")  # past row 1's N: not a row of it
    _, broken = rows.finish(0.8, "max", torch.tensor([4, 3]))
    assert broken.tolist() == [True, False]


def test_one_floor_formula_clamps_negative_efficient_rows():
    pooled = torch.tensor([-0.25, 0.0, 0.5, 1.0])
    torch.testing.assert_close(torch_backend.log_floor(pooled, 0.8),
                               torch.log(torch.tensor([0.2, 0.2, 0.6, 1.0])))
    assert pooled.tolist() == [-0.25, 0.0, 0.5, 1.0]  # the rows before the floor are kept (keep_pooled)
    assert "NaN in an attention row" in NAN_MESSAGE


def test_score_definitions():
    log_c = torch.tensor([[0.0, -30.0, -31.0, float("-inf")], [-1.0, -1.0, -1.0, -1.0]])
    z = log_zscores(log_c)
    finite = log_c[0, :3].double()
    want = (finite - finite.mean()) / finite.std(unbiased=False)
    torch.testing.assert_close(z[0, :3], want.float())
    assert z[0, 3] == float("-inf") and z[1].tolist() == [0.0] * 4
    paper = paper_zscores(log_c[:1, :3])
    c = torch.exp(finite - finite.max())
    torch.testing.assert_close(paper[0], ((c - c.mean()) / c.std(unbiased=False)).float())
    assert math.isclose(float(paper_zscores(log_c[0, :3])[0]), float(paper[0, 0]))


# ---- layering ---------------------------------------------------------------------------------------
LAYERS = ("ops", "core", "engines", "api", "apps")  # a module may import its own layer and the ones before it


def _imports() -> dict[str, set[str]]:
    """Every package module's imports of other package modules, module-level and function-level alike."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                subs = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
                found |= subs if len(subs) == len(node.names) else {target} | subs
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def _layer(module: str) -> int:
    """A module's layer: the folder it lives in under the package (the public vLLM facade, macs_kernels.vllm over
    engines/vllm, is an app); -1 for the package's lazy facade and `python -m macs_kernels`, which may import any
    layer."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return -1
    return LAYERS.index("apps" if parts[1] == "vllm" else parts[1])


def test_every_module_lives_in_a_layer_folder():
    assert not [module for module in _imports() if module.count(".") and module.split(".")[1] not in
                (*LAYERS, "vllm", "__main__")]


def test_the_public_paths_users_have_kept_their_place():
    """The folders moved (issue 39); what users import and run did not."""
    import importlib

    import macs_kernels
    from macs_kernels import ops

    assert all(callable(getattr(macs_kernels, name)) for name in macs_kernels.__all__ if name != "__version__")
    assert {"explain", "stream", "attach", "load_model", "qa_messages"} <= set(macs_kernels.__all__)
    assert all(callable(getattr(ops, name)) for name in ("decode_attention", "macs_update", "macs_pool",
                                                         "macs_pool_paged", "macs_update_rows", "macs_zscore",
                                                         "efficient_attention", "attention_features"))
    facade = importlib.import_module("macs_kernels.vllm")
    assert {"attach", "explain", "release", "WORKER_EXTENSION"} <= set(facade.__all__)
    module, name = facade.WORKER_EXTENSION.rsplit(".", 1)
    assert module == "macs_kernels.vllm.worker" and getattr(importlib.import_module(module), name).__name__ == name
    from importlib.metadata import entry_points

    (command,) = [point for point in entry_points(group="console_scripts") if point.name == "macs-kernels"]
    assert command.load() is importlib.import_module("macs_kernels.apps.cli").main


def test_the_package_has_no_import_cycle():
    graph, state, cycles = _imports(), {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles


def test_each_layer_imports_only_the_layers_below_it():
    wrong = [
        f"{module} ({LAYERS[_layer(module)]}) imports {target} ({LAYERS[_layer(target)]})"
        for module, targets in _imports().items() for target in targets
        if _layer(module) >= 0 and _layer(target) >= 0 and _layer(target) > _layer(module)
    ]
    assert not wrong


# ---- paged rows (the vLLM adapter's plan) --------------------------------------------------------------
def _paged(keys_per_row, page_size, pages_total, layout):
    """A paged cache holding each row's keys (H_kv, L, D) in shuffled pages, in `layout`, and its block table."""
    kv_heads, dim = keys_per_row[0].shape[0], keys_per_row[0].shape[2]
    order = torch.randperm(pages_total)
    pages = torch.zeros(pages_total, page_size, kv_heads, dim)
    width = max(-(-k.shape[1] // page_size) for k in keys_per_row)
    table = torch.full((len(keys_per_row), width + 1), -1, dtype=torch.int32)
    used = 0
    for r, keys in enumerate(keys_per_row):
        for j in range(-(-keys.shape[1] // page_size)):
            chunk = keys[:, j * page_size:(j + 1) * page_size].transpose(0, 1)
            pages[order[used], : chunk.shape[0]] = chunk
            table[r, j] = order[used]
            used += 1
    if layout == "vllm_cpu":  # [P, H_kv, page, 2D] with key blocks transposed
        cache = torch.zeros(pages_total, kv_heads, page_size, 2 * dim)
        flat = cache.view(pages_total, kv_heads, 2 * page_size * dim)
        flat[:, :, : page_size * dim] = pages.permute(0, 2, 3, 1).reshape(pages_total, kv_heads, -1)
        return key_pages(cache, True), table
    # FLASH_ATTN's [2, P, page, H_kv, D]: keys are its first half, unit stride in D
    cache = torch.stack([pages, torch.randn_like(pages)])
    return cache[0], table


@pytest.mark.parametrize("variant", ["plain", "window+sinks+softcap"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["vllm_cpu", "flash_attn"])
def test_paged_rows_equal_the_dense_op_per_row(layout, backend, variant):
    """PagedRows (the vLLM adapter's row plan) on vLLM's CPU cache layout and on FLASH_ATTN's GPU layout, per-row
    options in one pass, against ops.macs_pool on each row's keys laid out contiguously; a layer with a sliding
    window (shorter than some rows' inputs), sinks and a softcap (gpt-oss, Gemma 2) likewise."""
    if backend == "triton" and layout == "vllm_cpu":
        pytest.skip("the GPU backends read pages with a unit stride in D; vLLM's CPU keys are stored transposed")
    if backend == "triton":
        pytest.importorskip("triton")
    heads, kv_heads, dim, page_size = 6, 2, 32, 32
    lengths, n_input = [40, 97, 64, 130], [30, 60, 64, 100]
    configs = [MacsConfig(), MacsConfig(pooling="mean", alpha=0.5), MacsConfig(redistribute=False),
               MacsConfig(pooling="min", alpha=1.0)]
    keys = [torch.randn(kv_heads, length, dim) for length in lengths]
    k_pages, table = _paged(keys, page_size, 24, layout)
    query = torch.randn(11, heads, dim)
    rows = torch.tensor([2, 5, 7, 10])
    scorer = PagedRows(Kernels.of(backend), 2, rows, table, lengths, n_input, page_size, configs)
    layer_queries = [query, query * 0.5]
    extra = {} if variant == "plain" else dict(window=45, sinks=torch.linspace(-1.0, 4.0, heads), softcap=2.0)
    for layer, q in enumerate(layer_queries):
        scorer.pool(layer, q, k_pages, 0.3, Variant(**extra))
    log_c, broken = scorer.finish()
    assert not broken.any()
    for r, (config, length, n) in enumerate(zip(configs, lengths, n_input)):
        expected = torch.zeros(n)
        for q in layer_queries:
            pooled = macs_pool(q[rows[r]][None], keys[r][None], input_start=0, input_end=n, kv_len=length, scale=0.3,
                               pooling=config.pooling, redistribute=config.redistribute, backend="torch",
                               variant=Variant(**extra))
            expected += log_floor(pooled[0], config.alpha)
        torch.testing.assert_close(log_c[r, :n], expected, rtol=1e-5, atol=1e-5)
        assert (log_c[r, n:] == 0).all()


@pytest.mark.parametrize("variant", ["plain", "window+sinks+softcap"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_three_row_plans_take_one_signature_and_agree(backend, variant):
    """One RowPlan protocol: the same two sequences' last queries scored over a dense batch-major cache, a packed
    key tensor and a paged cache, each through `pool(layer, query, keys, scale, variant, gather)`, give the rows
    of ops.macs_pool run on each sequence alone (a window shorter than the first sequence's inputs)."""
    if backend == "triton":
        pytest.importorskip("triton")
    heads, kv_heads, dim, page_size, layers = 4, 2, 8, 4, 2
    lengths, n_input = [13, 9], [8, 5]
    config = MacsConfig(pooling="mean", alpha=0.5)
    window = None if variant == "plain" else 6
    layer_variant = Variant() if variant == "plain" else Variant(window=window, softcap=2.0,
                                                                 sinks=torch.linspace(-1.0, 2.0, heads))
    keys = [torch.randn(kv_heads, length, dim) for length in lengths]
    queries = [torch.randn(2, heads, dim) for _ in range(layers)]  # per layer: each sequence's last query
    kernels = Kernels.of(backend)

    dense_keys = torch.zeros(2, kv_heads, max(lengths), dim)
    for r, k in enumerate(keys):
        dense_keys[r, :, : k.shape[1]] = k
    dense_keys[1, :, lengths[1]:] = 1e4  # slots past the second sequence: never attended
    dense = DenseRows(kernels, layers, input_start=torch.tensor([0, 0]), input_end=torch.tensor(n_input),
                      kv_len=torch.tensor(lengths)[:, None], n_max=max(n_input), pooling=config.pooling,
                      redistribute=config.redistribute, alpha=config.alpha)
    segments = Segments([0, lengths[0]], lengths, n_input, [config.redistribute] * 2, "cpu", window=window)
    packed = PackedRows(kernels, layers, torch.tensor([0, 1]), segments, [config] * 2)
    k_pages, table = _paged(keys, page_size, 8, "flash_attn")
    paged = PagedRows(kernels, layers, torch.tensor([0, 1]), table, lengths, n_input, page_size, [config] * 2)
    plans = {
        "dense": (dense, lambda q: q[:, :, None], dense_keys, None),
        "packed": (packed, lambda q: q.transpose(0, 1)[None], torch.cat(keys, dim=1)[None], segments),
        "paged": (paged, lambda q: q, k_pages, None),
    }
    for name, (plan, query_of, layer_keys, gather) in plans.items():
        for layer, q in enumerate(queries):
            plan.pool(layer, query_of(q), layer_keys, 0.3, layer_variant, gather)
        log_c, broken = plan.finish()
        assert not broken.any()
        for r, (length, n) in enumerate(zip(lengths, n_input)):
            expected = sum(log_floor(macs_pool(
                q[r][None], keys[r][None], input_start=0, input_end=n, kv_len=length, scale=0.3,
                pooling=config.pooling, redistribute=config.redistribute, backend="torch", variant=layer_variant,
            )[0], config.alpha) for q in queries)
            torch.testing.assert_close(log_c.reshape(2, -1)[r, :n], expected, rtol=1e-5, atol=1e-5, msg=name)


def test_a_dense_plan_refuses_a_gather():
    plan = DenseRows(Kernels.of("torch"), 1, input_start=torch.tensor([0]), input_end=torch.tensor([2]),
                     kv_len=torch.tensor([[3]]), n_max=2, pooling="max", redistribute=True, alpha=0.8)
    with pytest.raises(ValueError, match="dense cache's keys are the layer's own"):
        plan.pool(0, torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4), 0.5, gather=object())



def _engine_and_core_classes():
    for path in sorted((PACKAGE / "engines").rglob("*.py")) + sorted((PACKAGE / "core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                yield path.relative_to(PACKAGE), node


def _assigned_attributes(node: ast.ClassDef) -> set[str]:
    """The instance attributes a class body assigns (`self.x = ...`) or declares (`x: type`)."""
    names = {target.target.id for target in node.body if isinstance(target, ast.AnnAssign)
             and isinstance(target.target, ast.Name)}
    return names | {sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) and sub.value.id == "self"}


def test_engine_and_core_classes_read_in_one_sitting():
    """Issue 49: no god object left in the layers that change with every engine: each class of engines/ and core/
    has at most 250 lines and 15 attributes."""
    too_big = [(str(path), node.name, node.end_lineno - node.lineno + 1, len(_assigned_attributes(node)))
               for path, node in _engine_and_core_classes()
               if node.end_lineno - node.lineno + 1 > 250 or len(_assigned_attributes(node)) > 15]
    assert too_big == []


def test_no_class_reads_another_ones_private_attributes():
    """In engines/ and core/, a private attribute of one of their classes is read through `self` only: what another
    class needs is public. (Private names of transformers' objects that the integration must reach, such as
    `model._reorder_cache`, are no class of ours.)"""
    private = {name for _, node in _engine_and_core_classes() for name in _assigned_attributes(node)
               if name.startswith("_") and not name.startswith("__")}
    reads = []
    for path in sorted((PACKAGE / "engines").rglob("*.py")) + sorted((PACKAGE / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reads.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert reads == []
