"""Each distinct Pallas kernel call of a program traced and lowered once.

Why: a decode program calls the same few kernels once per layer (the batch-1 decode chunk of
the 1.4B model: 120 pallas_calls, 5 per layer), with the same shapes and settings and only
other weights. JAX traces each call's kernel body and lowers it to Triton IR anew, and that
was nearly all of the program's trace and lowering time: 3.3 s + 7.1 s on a 2-core CPU
(`python -m benchmarks.lower_time`). That time is paid again by every process, the
persistent compilation cache notwithstanding (it keys on the lowered program), so it was
most of a cached start of the CLI (10.5-14.5 s on the H200).

Inside `scope()` (programs.ProgramCache opens one for every program it builds), `call(fn,
*args, **kwargs)` sends each kernel call through a `jax.jit` shared by every call with the
same function, the same non-array arguments and the same argument structure. JAX then traces
the kernel once per distinct call, lowers it to one MLIR function and calls that function
from every site; XLA inlines the calls, so the program it compiles has the same custom calls
as before (tests/test_trace_once.py compares the lowered kernels).

The jits live only as long as the scope: kernels read module-level tuning (e.g.
pallas_kernels.decode.TUNING, set between programs by the benchmarks' A/B arms), so a jit
kept from an earlier program could hand back a kernel traced under other settings. Outside
a scope, `call` is a plain call. OURO_JAX_TRACE_ONCE=0 in the environment (or ENABLED =
False) turns scopes into no-ops, for A/B runs against the unshared programs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable

import jax
import numpy as np

ENABLED = os.environ.get("OURO_JAX_TRACE_ONCE", "1") != "0"
_state = threading.local()


@contextlib.contextmanager
def scope():
    """Kernel calls made inside share their traces (see the module docstring)."""
    outer = getattr(_state, "jits", None)
    _state.jits = {} if ENABLED else None
    try:
        yield
    finally:
        _state.jits = outer


def active() -> bool:
    return getattr(_state, "jits", None) is not None


def call(fn: Callable, *args, **kwargs) -> Any:
    """fn(*args, **kwargs), through a jit shared with equal calls when a scope is active.

    Arrays (traced or not) are the jit's arguments; every other leaf of the arguments
    (ints, floats, strings, tuples of them) is part of the key and reaches fn as it was.
    A call with an unhashable non-array leaf is made directly."""
    jits = getattr(_state, "jits", None)
    if jits is None:
        return fn(*args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    statics = tuple(x for x, a in zip(leaves, is_array) if not a)
    key = (fn, treedef, is_array, statics)
    try:
        jitted = jits.get(key)
    except TypeError:  # an unhashable setting: no sharing for this call
        return fn(*args, **kwargs)
    if jitted is None:
        jitted = jits[key] = jax.jit(_rebuilder(fn, treedef, is_array, statics))
    return jitted(*[x for x, a in zip(leaves, is_array) if a])


def _rebuilder(fn, treedef, is_array, statics):
    def run(*arrays):
        arr, sta = iter(arrays), iter(statics)
        leaves = [next(arr) if a else next(sta) for a in is_array]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        return fn(*args, **kwargs)
    run.__name__ = getattr(fn, "__name__", "kernel")
    return run
