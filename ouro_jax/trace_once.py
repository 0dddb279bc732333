"""Each distinct Pallas kernel call of a program traced and lowered once.

Why: a decode program calls the same few kernels once per layer (the batch-1 decode chunk of
the 1.4B model: 120 pallas_calls, 5 per layer), with the same shapes and settings and only
other weights. JAX traces each call's kernel body and lowers it to Triton IR anew, and that
was nearly all of the program's trace and lowering time: 3.6 s + 6.8 s on a 2-core CPU
for the GPU program (`python -m benchmarks.lower_time --platform cuda`,
benchmarks/results/lower_time_cuda_cpu_jax0102.json). Every process pays it again, the
persistent compilation cache notwithstanding (that cache keys on the lowered program).

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
import struct
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
    (ints, floats, strings, tuples of them) is part of the key, with its type (_exact), and
    reaches fn as it was. A call with an unhashable non-array leaf is made directly."""
    jits = getattr(_state, "jits", None)
    if jits is None:
        return fn(*args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    statics = tuple(x for x, a in zip(leaves, is_array) if not a)
    key = (fn, treedef, is_array, tuple(_exact(x) for x in statics))
    try:
        jitted = jits.get(key)
    except TypeError:  # an unhashable setting: no sharing for this call
        return fn(*args, **kwargs)
    if jitted is None:
        jitted = jits[key] = jax.jit(_rebuilder(fn, treedef, is_array, statics))
    return jitted(*[x for x, a in zip(leaves, is_array) if a])


def _exact(x):
    """A setting's key part: values that compare equal but act differently stay apart (True
    and 1, 2.0 and np.float32(2), 0.0 and -0.0): the type, and floats by their bits."""
    if isinstance(x, float):
        return float, struct.pack("<d", x)
    if isinstance(x, np.generic):
        return type(x), x.tobytes()
    return type(x), x


def _rebuilder(fn, treedef, is_array, statics):
    def run(*arrays):
        arr, sta = iter(arrays), iter(statics)
        leaves = [next(arr) if a else next(sta) for a in is_array]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        return fn(*args, **kwargs)
    run.__name__ = getattr(fn, "__name__", "kernel")
    return run
