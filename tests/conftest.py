import os

# The Triton interpreter must be chosen before triton is imported; a GPU run sets TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of small ops: two threads on two busy cores contend, and forwards of
    small models get several times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_runtest_logreport(report):
    """With MACS_KERNELS_EARLY_FAILURES=1 (.ci/gpu's test stages), each failure's traceback is printed when it happens,
    not only in the summary at the end: a stage killed at its time limit still says why its tests failed (one did,
    on an H200, with three failures and nothing but dots to show). xdist's workers talk to the controller over their
    stdout, so only the controller (or a run without workers) prints."""
    if (report.failed and os.environ.get("MACS_KERNELS_EARLY_FAILURES") == "1"
            and "PYTEST_XDIST_WORKER" not in os.environ):
        import sys

        sys.__stdout__.write(f"\n--- failed: {report.nodeid} ({report.when})\n{report.longreprtext}\n---\n")
        sys.__stdout__.flush()
