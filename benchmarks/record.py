"""The record every benchmark writes: the command, the machine, the JAX version, the git commit
and a digest of the code that ran (`save_record`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys

import jax

CODE_DIRS = ("ouro_jax", "pallas_kernels", "convert", "benchmarks")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """HEAD of this repository, with "+dirty" when the tracked code (CODE_DIRS, not result
    files) differs from it: a device copy of a working tree can sit on an older HEAD than the
    code it runs; source_digest pins the code itself."""
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=REPO_ROOT,
                                       stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE_DIRS[:-1],
                                "benchmarks/*.py"], cwd=REPO_ROOT,
                               stderr=subprocess.DEVNULL).returncode != 0
        return head + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def source_digest() -> str:
    """sha256 (first 16 hex digits) over the Python sources that produce a result, by path
    and content: equal digests mean the same code, whatever git says."""
    root = REPO_ROOT
    h = hashlib.sha256()
    for d in CODE_DIRS:
        for dirpath, _, files in sorted(os.walk(os.path.join(root, d))):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


def save_record(module: str, argv, out, **fields) -> dict:
    """The result record every benchmark writes: the command, machine, JAX version and git
    commit, then the benchmark's own fields; saved as JSON to `out` when given."""
    record = dict(command=f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv),
                  device=jax.devices()[0].device_kind, platform=platform.platform(),
                  jax_version=jax.__version__, git_commit=git_commit(),
                  source_sha256=source_digest(),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), **fields)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
    return record
