"""Launch a Pallas (Triton) kernel ourselves, with programmatic dependent launch (PDL).

Why: a one-row decode step is ~580 short kernels, and each GEMV pays ~1 us for its first
weight blocks plus a launch gap (docs/performance.md, "Where the time goes"). With PDL a
kernel may launch while the one ahead of it still runs, request its weights (which do not
depend on that kernel), and only then wait (`griddepcontrol.wait`) before it reads the
previous kernel's output. gemv_stream's `pdl="start"|"end"` already orders its code that way
(first weight block, wait, then x and the norm prologue). But XLA, which launches the Pallas
kernels (the `__gpu$xla.gpu.triton` custom call in jax 0.10.2 and 0.11.2), launches every
kernel with PDL and its own wait at the kernel's start, so the later wait never mattered
(session 10). Measured (session 25, H100; docs/performance.md, "Tried, did not help"):
Triton GEMVs shaped like ours in a PyTorch CUDA graph ran 36.0 against 41.1-42.6 us per
layer application with no PDL at all (`benchmarks.pdl_chain`); the engine's kernels through
this launcher ran level with JAX's own launch, not faster (`benchmarks.pdl_jax_chain`).

How: `compile_pallas` lowers one pallas_call for the GPU, keeps the Triton IR it emits (the
IR XLA would compile) and compiles it to a cubin with the `triton` package (PyTorch's, on
the GPU machine; XLA's own Triton is not callable from Python). `call` then runs it through
an XLA FFI custom call (pallas_kernels/pdl_launch.cc, built on first use with the host C++
compiler against jaxlib's FFI headers and cuda.h; the driver is opened with dlopen) that
launches it on XLA's stream with `cuLaunchKernelEx`, the PDL attribute on or off. The
kernel's image is handed to the library once (`register_kernel`, at trace time); the custom
call carries only its id and launch shape (a first version carried the cubin as an
attribute; moving it out changed nothing measurable).

Safety: a kernel launched with PDL may start before the one ahead of it ends, so everything it
does before its `griddepcontrol.wait` must read only data no earlier kernel in the program
writes (weights), and write nothing an earlier kernel may still read or write. `call` and
`sequence` refuse `pdl=True` for a kernel whose PTX has no wait at all; they cannot check
that the wait is on every path or ahead of every dependent read and every write: that is the
kernel's contract (gemv_stream's `pdl` modes; tests/test_pdl.py checks their IR). A trigger
in a kernel lets the *next* kernel launch early: every kernel that may follow (ours or XLA's)
must wait before its first dependent read; XLA's own kernels wait at their start.

GPU only (CUDA, the `triton` package); tests/test_pdl_launch.py builds
the library and checks the capture on the CPU, and runs kernels on a GPU.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np

TARGET = "ouro_pdl_launch"
TARGET_GRAPH = "ouro_pdl_launch_cmdbuf"  # the handler XLA may record into a CUDA graph
TARGET_SEQ = "ouro_pdl_sequence"  # several kernels per custom call (`sequence`)
TARGET_SEQ_GRAPH = "ouro_pdl_sequence_graph"  # the same, replayed as a CUDA graph of our own
TARGET_SIDE = "ouro_side_launch"  # one kernel on a stream of our own (`side_call`)
SOURCE = Path(__file__).with_name("pdl_launch.cc")
# the parts pdl_launch.cc includes (the build's cache key covers them too)
PARTS = [Path(__file__).with_name(n) for n in ("pdl_launch_side.inc", "pdl_launch_graph.inc")]
_lock = threading.Lock()
_registered: list = []  # [the loaded library] once the FFI target is registered
_kernels: set[int] = set()  # kernel ids whose images the library holds


def jaxlib_include() -> Path:
    import jaxlib
    inc = Path(jaxlib.__file__).parent / "include"
    if not (inc / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib's FFI headers are missing under {inc}")
    return inc


def cuda_include() -> Path:
    """A folder with cuda.h: $CUDA_HOME, nvcc's toolkit, /usr/local/cuda, or the NVIDIA pip
    wheels' headers."""
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent / "include")
    cands.append(Path("/usr/local/cuda/include"))
    try:
        import nvidia
        for root in nvidia.__path__:
            cands += sorted(Path(root).glob("*/include"))
    except ImportError:
        pass
    for c in cands:
        if (c / "cuda.h").exists():
            return c
    raise RuntimeError("cuda.h not found (set CUDA_HOME): the PDL launcher is built from "
                       f"pallas_kernels/pdl_launch.cc on first use; looked in {cands}")


def default_cache() -> Path:
    """A per-user folder ($XDG_CACHE_HOME or ~/.cache, then ouro_jax/pdl_launch): a shared
    temp folder would let another user plant the library we load."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ouro_jax" / "pdl_launch"


def _check_owned(path: Path) -> None:
    st = path.stat()
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise RuntimeError(f"{path} is not owned by this user or is writable by others; "
                           "remove it (or set OURO_PDL_CACHE) before loading the launcher")


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """Builds the launcher library (once per source, jaxlib and cuda.h) and returns its path."""
    import jaxlib.version
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) to build the PDL launcher")
    inc, cuda = jaxlib_include(), cuda_include()
    key = hashlib.sha256(SOURCE.read_bytes() + b"".join(p.read_bytes() for p in PARTS)
                         + jaxlib.version.__version__.encode()
                         + (cuda / "cuda.h").read_bytes()).hexdigest()[:16]
    cache = Path(cache_dir or os.environ.get("OURO_PDL_CACHE") or default_cache())
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    out = cache / f"libouro_pdl_{key}.so"
    if out.exists():
        _check_owned(out)
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{inc}", f"-I{cuda}",
           str(SOURCE), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"building the PDL launcher failed: {' '.join(cmd)}\n{res.stderr}")
    os.replace(tmp, out)
    return out


def declare(lib) -> None:
    """The ctypes signatures of the library's C entry points."""
    i64, i64p = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
    lib.OuroPdlRegister.argtypes = [i64, ctypes.c_char_p, i64, ctypes.c_char_p, i64]
    lib.OuroPdlRegister.restype = ctypes.c_int
    lib.OuroPdlStats.argtypes = [i64p, ctypes.c_int]
    lib.OuroPdlStats.restype = None
    lib.OuroPdlCheckPlan.argtypes = [i64p, i64, i64]
    lib.OuroPdlCheckPlan.restype = ctypes.c_int
    lib.OuroPdlGraphStats.argtypes = [i64p, ctypes.c_int]
    lib.OuroPdlGraphStats.restype = None
    lib.OuroSideSync.argtypes = []
    lib.OuroSideSync.restype = ctypes.c_int


def register() -> None:
    """Registers the FFI target for CUDA (once per process)."""
    with _lock:
        if _registered:
            return
        lib = ctypes.cdll.LoadLibrary(str(build()))
        declare(lib)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.OuroPdlLaunch),
                                    platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_GRAPH, jax.ffi.pycapsule(lib.OuroPdlLaunchGraph),
                                    platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_SEQ, jax.ffi.pycapsule(lib.OuroPdlSequence),
                                    platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_SEQ_GRAPH,
                                    jax.ffi.pycapsule(lib.OuroPdlSequenceGraph),
                                    platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_SIDE, jax.ffi.pycapsule(lib.OuroSideLaunch),
                                    platform="CUDA")
        _registered.append(lib)


def host_stats(reset: bool = False) -> dict:
    """The launcher's host-side timing since the last reset: handler calls, and per call the
    microseconds inside the handler, inside cuLaunchKernelEx, and from one call's entry to
    the next's (the host's cadence; large where the GPU waits on the host)."""
    register()
    out = (ctypes.c_int64 * 4)()
    _registered[0].OuroPdlStats(out, int(reset))
    calls = out[0]
    per = (lambda ns: round(ns / calls / 1e3, 3)) if calls else (lambda ns: None)
    # entry-to-entry intervals: calls - 1 of them, the gaps between programs included
    between = round(out[3] / (calls - 1) / 1e3, 3) if calls > 1 else None
    return dict(calls=calls, us_in_handler=per(out[1]), us_in_launch=per(out[2]),
                us_between_calls=between)


def graph_stats(reset: bool = False) -> dict:
    """How many CUDA graphs `sequence(..., graph=True)` recorded (a call whose plan and buffer
    addresses were new), how many calls replayed one, and how often the full cache (1,024
    graphs) was dropped, since the last reset."""
    register()
    out = (ctypes.c_int64 * 3)()
    _registered[0].OuroPdlGraphStats(out, int(reset))
    return dict(recorded=out[0], replayed=out[1], dropped=out[2])


def register_kernel(kernel: "Kernel") -> None:
    """Hands the kernel's image to the launcher library (once per process and kernel)."""
    register()
    with _lock:
        if kernel.kernel_id in _kernels:
            return
        if _registered[0].OuroPdlRegister(kernel.kernel_id, kernel.image, len(kernel.image),
                                          kernel.name.encode(), kernel.n_params):
            raise RuntimeError(f"kernel id {kernel.kernel_id} already holds another kernel")
        _kernels.add(kernel.kernel_id)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One compiled kernel: its cubin, entry name, launch shape, its parameter count (PTX) and
    how many of those are the pallas_call's operands and results (the rest: Triton's scratch
    pointers, passed as nulls)."""
    image: bytes
    name: str
    grid: int
    threads: int
    shared: int
    n_params: int
    n_buffers: int
    has_wait: bool
    has_trigger: bool
    grid_yz: tuple = (1, 1)  # a 2-D / 3-D grid's other sizes (sequence launches those too)

    @functools.cached_property
    def kernel_id(self) -> int:
        return int.from_bytes(hashlib.sha256(self.image).digest()[:7], "little")


def capture_module(fn, *args):
    """Lowers fn(*args) (which must run exactly one pallas_call) for the GPU and returns
    (Triton IR as text, its grid as 3 sizes) as Pallas emitted them."""
    from pallas_kernels.offline_compile import triton_modules
    seen = triton_modules(fn, *args)
    if len(seen) != 1:
        raise ValueError(f"capture_module: fn must run exactly one pallas_call, saw {len(seen)}")
    module, grid = seen[0]
    if len(grid) > 3:
        raise ValueError(f"the PDL launcher takes grids of up to 3 dimensions, got {grid}")
    return module, tuple(int(g) for g in grid) + (1,) * (3 - len(grid)) if grid else (1, 1, 1)


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)


def ir_buffer_count(module: str) -> int:
    """How many pointer arguments the Triton IR's kernel function takes (the pallas_call's
    operands and results)."""
    heads = [line for line in module.splitlines() if "tt.func" in line]
    if len(heads) != 1:
        raise ValueError(f"expected one tt.func in the Triton IR, found {len(heads)}")
    return len(re.findall(r"%arg\d+\s*:", heads[0]))


def parse_ptx(ptx: str):
    """(entry name, parameter count) of the PTX's one kernel."""
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise ValueError(f"expected one .entry in the PTX, found {len(entries)}")
    name, params = entries[0]
    return name, params.count(".param")


def compile_pallas(fn, *args, num_warps: int, num_stages: int, arch: int = 90) -> Kernel:
    """fn(*args)'s one pallas_call compiled to a cubin for sm_`arch` by the `triton` package
    (PyTorch's, on the GPU machine): JAX 0.11 hands Pallas' IR to XLA's own Triton, which
    Python cannot call, so the same IR goes through the package (another Triton version: its
    code may differ from XLA's in ways that change rounding; tests compare the two)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise RuntimeError("the PDL launcher compiles kernels with the `triton` package, "
                           "which is not installed") from e
    module, grid = capture_module(fn, *args)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as fh:
            fh.write(module)
        k = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
    md = k.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, field, 0):
            raise ValueError(f"kernel {md.name} needs {getattr(md, field)} B of {field}, "
                             "which the PDL launcher does not allocate")
    if getattr(md, "num_ctas", 1) != 1 or any(c != 1 for c in getattr(md, "cluster_dims",
                                                                        (1, 1, 1))):
        raise ValueError(f"kernel {md.name}: the PDL launcher launches no thread-block "
                         "clusters")
    ptx = k.asm["ptx"]
    name, n_params = parse_ptx(ptx)
    n_buffers = ir_buffer_count(module)
    if n_buffers > n_params:
        raise ValueError(f"kernel {name}: {n_buffers} IR arguments but {n_params} PTX "
                         "parameters")
    return Kernel(image=bytes(k.asm["cubin"]), name=name, grid=grid[0], grid_yz=grid[1:],
                  threads=32 * int(getattr(md, "num_warps", num_warps)),
                  shared=int(md.shared), n_params=n_params, n_buffers=n_buffers,
                  has_wait="griddepcontrol.wait" in ptx,
                  has_trigger="griddepcontrol.launch_dependents" in ptx)


def _check_one_kernel(kernel: Kernel, out_shapes, args, grids: str) -> None:
    """call's and side_call's checks: a 1-D grid, and one buffer per operand and result."""
    if tuple(kernel.grid_yz) != (1, 1):
        raise ValueError(f"kernel {kernel.name} has a grid of {(kernel.grid, *kernel.grid_yz)}: "
                         + grids)
    outs = out_shapes if isinstance(out_shapes, (list, tuple)) else [out_shapes]
    if len(args) + len(outs) != kernel.n_buffers:
        raise ValueError(f"kernel {kernel.name} takes {kernel.n_buffers} operands and results, "
                         f"called with {len(args)} operands and {len(outs)} results")


def call(kernel: Kernel, out_shapes, *args, pdl: bool, graph: bool = False):
    """Runs `kernel` on args (inside jit) through the FFI launcher; out_shapes as
    jax.ffi.ffi_call's. pdl: launch with the PDL attribute (the kernel must wait before its
    first read of an earlier kernel's output). graph: through the handler that XLA may record
    into its command buffers (CUDA graphs) like its own kernels."""
    if pdl and not kernel.has_wait:
        raise ValueError(f"kernel {kernel.name} has no griddepcontrol.wait: launching it with "
                         "PDL would let it read its inputs before the kernel ahead has written "
                         "them")
    _check_one_kernel(kernel, out_shapes, args, "call launches 1-D grids (sequence takes "
                      "any)")
    extra = kernel.n_params - kernel.n_buffers
    register_kernel(kernel)
    return jax.ffi.ffi_call(TARGET_GRAPH if graph else TARGET, out_shapes)(
        *args, kernel_id=np.int64(kernel.kernel_id), grid=np.int64(kernel.grid),
        threads=np.int64(kernel.threads), shared=np.int64(kernel.shared),
        extra_params=np.int64(extra), pdl=bool(pdl))


def sequence_plan(steps, n_args: int, n_outs: int) -> np.ndarray:
    """The launcher's plan for `sequence`: steps are (Kernel, params, pdl), params a list of
    ("in", i) / ("out", j) naming the call's operands and results in the kernel's parameter
    order (its inputs, then its outputs); Triton's extra parameters are appended as nulls."""
    plan = [len(steps)]
    for kernel, params, pdl in steps:
        if pdl and not kernel.has_wait:
            raise ValueError(f"kernel {kernel.name} has no griddepcontrol.wait: it cannot be "
                             "launched with PDL")
        if len(params) != kernel.n_buffers:
            raise ValueError(f"kernel {kernel.name} takes {kernel.n_buffers} operands and "
                             f"results, given {len(params)}")
        extra = kernel.n_params - kernel.n_buffers
        idx = []
        for kind, i in params:
            if kind == "in" and 0 <= i < n_args:
                idx.append(i)
            elif kind == "out" and 0 <= i < n_outs:
                idx.append(n_args + i)
            else:
                raise ValueError(f"bad parameter {(kind, i)} for {n_args} operands and "
                                 f"{n_outs} results")
        plan += [kernel.kernel_id, kernel.grid, *kernel.grid_yz, kernel.threads, kernel.shared,
                 int(bool(pdl)), kernel.n_params, *idx, *([-1] * extra)]
    return np.asarray(plan, np.int64)


def check_plan(plan: np.ndarray, n_buffers: int) -> bool:
    """The library's own check of a plan (the one Sequence runs before any launch)."""
    register()
    plan = np.ascontiguousarray(plan, np.int64)
    return _registered[0].OuroPdlCheckPlan(
        plan.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), plan.size, n_buffers) == 0


def sequence(steps, out_shapes, *args, graph: bool = False, aliases=None):
    """Several kernels launched in order by one custom call (one host call for all of them):
    steps as sequence_plan's; returns the results (out_shapes, a list). graph: the kernels
    are recorded once into a CUDA graph of the launcher's own (a PDL launch becomes a
    programmatic edge, which XLA's command buffers drop) and the graph is replayed on later
    calls whose buffers sit at the same addresses (`graph_stats`). aliases: {operand index:
    result index}, results that take their operand's buffer (updated in place; donate the
    operand); a kernel that updates such a buffer names the result ("out", j) for it."""
    aliases = dict(aliases or {})
    for i, j in aliases.items():
        if not (0 <= i < len(args) and 0 <= j < len(out_shapes)):
            raise ValueError(f"alias {i} -> {j} outside {len(args)} operands and "
                             f"{len(out_shapes)} results")
        a, o = args[i], out_shapes[j]
        if (tuple(a.shape), a.dtype) != (tuple(o.shape), o.dtype):
            raise ValueError(f"alias {i} -> {j}: operand {a.dtype}{list(a.shape)} and result "
                             f"{o.dtype}{list(o.shape)} differ")
    if len(set(aliases.values())) != len(aliases):
        raise ValueError(f"aliases {aliases}: a result takes at most one operand's buffer")
    plan = sequence_plan(steps, len(args), len(out_shapes))
    for kernel, _, _ in steps:
        register_kernel(kernel)
    target = TARGET_SEQ_GRAPH if graph else TARGET_SEQ
    return jax.ffi.ffi_call(target, list(out_shapes), input_output_aliases=aliases or None)(
        *args, plan=plan)
