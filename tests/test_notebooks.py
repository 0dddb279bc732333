"""Executes every notebook in notebooks/ top to bottom; any failing cell fails the test.

The kernel is the interpreter running the tests (`sys.executable`), through a kernelspec written
to a temporary folder and handed to the kernel manager directly, so nothing has to be
installed with `ipykernel install` and a user-level `python3` kernelspec pointing elsewhere is
never picked up. The kernel runs in notebooks/ with the repository root first on PYTHONPATH,
so the notebooks exercise this checkout (whether or not it was installed with `pip install -e`).
Notebooks are executed in memory; the files (with their saved outputs) are not rewritten.

    python tests/test_notebooks.py [NOTEBOOK ...]   # re-execute and save outputs in place
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Whole-notebook limit (a hung cell is stopped by it too). Each notebook runs in 10-30 s on a
# 2-core CPU; the margin is for a loaded CI machine.
NOTEBOOK_TIMEOUT_S = 180
KERNEL_NAME = "ouro-jax-tests-python"


def _write_kernelspec(folder: Path) -> Path:
    spec_dir = folder / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ouro_jax tests)",
        "language": "python",
        "metadata": {"debugger": False},
    }))
    return folder


def execute_notebook(path: Path, timeout_s: float = NOTEBOOK_TIMEOUT_S):
    """Runs the notebook at `path` in a fresh kernel; returns (executed notebook, seconds).
    Raises nbclient's CellExecutionError on the first failing cell, TimeoutError past
    `timeout_s`."""
    nb = nbformat.read(str(path), as_version=4)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    with tempfile.TemporaryDirectory(prefix="ouro_nb_kernels_") as tmp:
        ksm = KernelSpecManager(kernel_dirs=[str(_write_kernelspec(Path(tmp)))])
        km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)
        # The per-cell limit is only a backstop; the whole-notebook limit below fires first.
        client = NotebookClient(nb, km=km, kernel_name=KERNEL_NAME, timeout=int(timeout_s) + 30,
                                resources={"metadata": {"path": str(path.parent)}})
        t0 = time.perf_counter()
        try:
            asyncio.run(asyncio.wait_for(client.async_execute(env=env), timeout_s))
        except (asyncio.TimeoutError, DeadKernelError) as e:
            # nbclient turns the cancellation by wait_for into DeadKernelError.
            if time.perf_counter() - t0 >= timeout_s:
                raise TimeoutError(f"{path.name} did not finish within {timeout_s} s") from e
            raise
        seconds = time.perf_counter() - t0
    # Keep the file's own kernelspec (plain python3), not the temporary test kernel.
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb, seconds


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_saved_outputs(path):
    """The committed notebooks carry their outputs: every code cell was executed, none failed."""
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        assert cell.execution_count is not None, f"{path.name} cell {i} has no saved output"
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{path.name} cell {i} saved an error: {errors[0].get('ename')}"


@pytest.mark.slow  # a few to ~30 seconds each; part of the normal suite (`make test`)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    _, seconds = execute_notebook(path)
    assert seconds < NOTEBOOK_TIMEOUT_S


if __name__ == "__main__":
    for arg in sys.argv[1:] or [str(p) for p in NOTEBOOKS]:
        p = Path(arg).resolve()
        executed, secs = execute_notebook(p)
        nbformat.write(executed, str(p))
        print(f"{p.name}: {secs:.1f} s")
