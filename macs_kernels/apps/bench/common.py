"""What every benchmark shares: the environment columns (machine, versions, commit), CSV writing, file
stems per device and figures. Used by `macs-kernels bench` and the programs in benchmarks/.

Nothing here assumes a git checkout: the commit is recorded when the source runs from its own checkout or
pip recorded it for a VCS install, and left empty otherwise.
"""
from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2]


def source_commit(short: bool = False) -> str | None:
    """The git commit of the macs_kernels source in use, or None when it cannot be known.

    From git only when the package lies in its own checkout (not in some repository that happens to
    enclose a site-packages folder); else from pip's direct_url.json of a `pip install git+...`.
    """
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=PACKAGE_DIR, capture_output=True, text=True,
                                  check=True).stdout.strip() or None
        except (OSError, subprocess.CalledProcessError):
            return None

    top = git("rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == PACKAGE_DIR.parent:
        return git("rev-parse", *(["--short"] if short else []), "HEAD")
    from importlib import metadata

    try:
        direct_url = metadata.distribution("macs_kernels").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    commit = json.loads(direct_url).get("vcs_info", {}).get("commit_id") if direct_url else None
    return commit[:7] if commit and short else commit


def environment(device) -> dict:
    """Machine, versions and commit columns of every benchmark CSV (commit empty when unknown)."""
    import torch

    versions = {}
    for module in ("transformers", "triton"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = "absent"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")] if cpuinfo.exists() else []
        name = f"{models[0] if models else platform.processor() or platform.machine()} x{os.cpu_count()}"
    return {"machine": platform.node(), "device": name, "python": platform.python_version(),
            "torch": torch.__version__, **versions, "threads": torch.get_num_threads(),
            "commit": source_commit() or ""}


def write_csv(rows: list[dict], path: Path, columns=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns or rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def device_stem(prefix: str, env: dict, device) -> str:
    """results file stem: <prefix>_cpu or <prefix>_<gpu model>, e.g. generate_h100."""
    import torch

    if torch.device(device).type == "cpu":
        return f"{prefix}_cpu"
    return f"{prefix}_" + env["device"].split()[-1].lower().replace("-", "_")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run on machines without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path, dpi: int = 110) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
