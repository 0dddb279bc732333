"""The record every benchmark writes: the command, the machine, the JAX version, the git commit
and a digest of the code that ran (`save_record`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys

import jax

CODE_DIRS = ("ouro_jax", "pallas_kernels", "convert", "benchmarks")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """HEAD of this repository, with "+dirty" when the code (CODE_DIRS' Python files, tracked
    or not; not result files) differs from it: a device copy of a working tree can sit on an
    older HEAD than the code it runs; source_digest pins the code itself. The comparison
    hashes each file's content against HEAD's blob (code_differs), since git's own diff
    trusts the index's stat data, which a copied tree can carry over unchanged (session 31's
    device records read a stale HEAD with no "+dirty")."""
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=REPO_ROOT,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"
    try:
        return head + ("+dirty" if code_differs(head) else "")
    except Exception:  # the HEAD is still worth recording
        return head + "+unchecked"


def _blob_sha1(path: str) -> str:
    """git's blob id for what `path` holds as a tree entry (a symlink: its target path)."""
    if os.path.islink(path):
        data = os.fsencode(os.readlink(path))
    else:
        with open(path, "rb") as f:
            data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def code_differs(rev: str = "HEAD") -> bool:
    """Whether any Python file under CODE_DIRS differs from `rev`'s: changed, added or
    removed, by content (git's blob ids), not by the index."""
    out = subprocess.check_output(["git", "ls-tree", "-r", "-z", rev, "--", *CODE_DIRS],
                                  cwd=REPO_ROOT, stderr=subprocess.DEVNULL)
    committed = {}
    for entry in filter(None, out.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        path = os.fsdecode(path)
        if path.endswith(".py"):
            committed[path] = meta.split()[2].decode()
    present = {}
    for d in CODE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, d)):
            for name in files:
                if name.endswith(".py"):
                    full = os.path.join(dirpath, name)
                    present[os.path.relpath(full, REPO_ROOT)] = _blob_sha1(full)
    return present != committed


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
    # (shlex: an empty or spaced argument, e.g. --compile-cache '', stays rerunnable)
    args = sys.argv[1:] if argv is None else argv
    record = dict(command=f"python -m {module} " + shlex.join(str(a) for a in args),
                  device=jax.devices()[0].device_kind, platform=platform.platform(),
                  jax_version=jax.__version__, git_commit=git_commit(),
                  source_sha256=source_digest(),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), **fields)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
    return record
