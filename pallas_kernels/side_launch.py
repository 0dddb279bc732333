"""One kernel on a CUDA stream of our own, beside XLA's (session 34).

Why: the L2 weight prefetcher (pallas_kernels/side_prefetch.py) must run beside the decode
chain, inside the decode loop's while body, where XLA's own second stream
(`compute_on("gpu_stream:1")`) overlaps nothing and XLA scheduled it after the chain
(docs/performance.md, session 34). `side_call` goes around XLA's scheduler: a handler of
the FFI launcher library (pallas_kernels/pdl_launch_side.inc, built and registered by
pallas_kernels.pdl_launch) forks a stream of its own from XLA's by an event and launches
the kernel there. docs/kernels.md has the buffer handling and the review's mends.
"""
from __future__ import annotations

import jax
import numpy as np

from pallas_kernels.pdl_launch import (TARGET_SIDE, Kernel, _check_one_kernel, _registered,
                                       register, register_kernel)


def side_call(kernel: Kernel, out_shapes, *args, static_args: int = 0):
    """Launches `kernel` on a CUDA stream of the launcher's own, after everything XLA's
    stream has run before this call, and returns at once: the kernel runs beside the
    kernels XLA launches after it (XLA's compute_on streams overlap nothing inside a loop
    body; session 34) and nothing ever waits for it. The operands are copied into the
    launcher's buffers first (XLA may reuse its own once this call is behind it) and the
    kernel's results go to the launcher's buffers too: the returned arrays are zeros. So
    the kernel's only effects must be ones XLA cannot see and values cannot depend on,
    such as L2 prefetches (pallas_kernels/side_prefetch.py); raw addresses it reads must
    stay valid for as long as it may run. static_args: the first that many operands never
    change between calls (the caller's promise), so they are copied only once per buffer
    set. `side_sync()` waits for the side streams."""
    if kernel.has_wait or kernel.has_trigger:
        raise ValueError(f"kernel {kernel.name} uses PDL (griddepcontrol): a kernel on a "
                         "stream of its own has no kernel ahead of it to wait for")
    _check_one_kernel(kernel, out_shapes, args, "side_call launches 1-D grids")
    if not 0 <= static_args <= len(args):
        raise ValueError(f"static_args {static_args} for {len(args)} operands")
    register_kernel(kernel)
    return jax.ffi.ffi_call(TARGET_SIDE, out_shapes, has_side_effect=True)(
        *args, kernel_id=np.int64(kernel.kernel_id), grid=np.int64(kernel.grid),
        threads=np.int64(kernel.threads), shared=np.int64(kernel.shared),
        extra_params=np.int64(kernel.n_params - kernel.n_buffers),
        static_args=np.int64(static_args))


def side_sync() -> None:
    """Waits until every side stream has run what side_call launched on it."""
    register()
    if _registered[0].OuroSideSync():
        raise RuntimeError("synchronising the side launch's streams failed")
