"""Ahead-of-time compiled device programs, keyed by static settings and argument shapes.

Compiling explicitly (`jit(...).lower(...).compile()`) lets the engine report compile time
apart from run time, and lets tests count compiles: a second call whose shapes fall in the
same buckets finds its programs here and compiles nothing.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import jax

from ouro_jax import trace_once


def _shape_key(args) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return (treedef, tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))))
                           for x in leaves))


def compiler_options(static: dict) -> dict | None:
    """XLA options for a program: ouro_jax.invariant's programs keep every rounding their
    HLO asks for (xla_allow_excess_precision off), so that which ops XLA fuses, which may
    differ between the decode and the verification program, cannot change their bits."""
    from ouro_jax.invariant import applies
    backend = static.get("backend")
    return ({"xla_allow_excess_precision": False}
            if isinstance(backend, str) and applies(backend) else None)


class ProgramCache:
    def __init__(self):
        self._programs: dict[Any, Any] = {}
        self.compiles = 0
        self.compile_seconds = 0.0
        # on_compile(name, seconds): called with None before a program compiles, then with
        # its compile time, or NaN if the compile raised (the CLI prints progress through
        # it); None: silent
        self.on_compile: Optional[Callable[[str, Optional[float]], None]] = None

    def call(self, fn: Callable, static: dict, donate: tuple[int, ...], *args):
        """Runs fn(*args, **static), compiled once per (fn, static, shapes)."""
        key = (fn, tuple(sorted(static.items())), donate, _shape_key(args))
        prog = self._programs.get(key)
        if prog is None:
            name = getattr(fn, "__name__", "program")
            if self.on_compile is not None:
                self.on_compile(name, None)
            t0 = time.perf_counter()
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
            try:
                with trace_once.scope():  # each distinct kernel call traced once
                    lowered = jitted.lower(*args)
                prog = lowered.compile(compiler_options=compiler_options(static))
            except BaseException:
                if self.on_compile is not None:
                    self.on_compile(name, float("nan"))
                raise
            seconds = time.perf_counter() - t0
            self.compile_seconds += seconds
            self.compiles += 1
            self._programs[key] = prog
            if self.on_compile is not None:
                self.on_compile(name, seconds)
        return prog(*args)

    def lowered_text(self, fn: Callable, static: dict, donate: tuple[int, ...], *args) -> str:
        """The optimized HLO of a program, for inspection (e.g. one while loop, no callbacks)."""
        jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
        with trace_once.scope():
            lowered = jitted.lower(*args)
        return lowered.compile(compiler_options=compiler_options(static)).as_text()
