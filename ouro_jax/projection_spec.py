"""The projections spec strings: 'xla', 'auto', or '+'-joined parts such as
'gemv+norms+stream' (ouro_jax.projections.parse's docstring lists them), read into the
projection objects of ouro_jax.projections. Split from that module, which re-exports
`parse`, `resolve` and `auto_fit`."""

from __future__ import annotations

import dataclasses

import jax

from ouro_jax.projection_tuning import (GEMM_MAX_ROWS, GEMM_ROW_LIMIT, GEMV_MAX_ROWS,
                                        GEMV_ROW_LIMIT, INV_ROWS, NAMES, STREAM_MAX_ROWS)


def resolve(spec: str) -> str:
    """'auto' -> GPU_DEFAULT where the Pallas kernels run natively (a GPU), else 'xla' (on a
    CPU the kernel would run in interpret mode: exact but slow). Other specs pass through."""
    if spec != "auto":
        return spec
    from ouro_jax.attention import resolve_backend
    from ouro_jax import projections
    return projections.GPU_DEFAULT if resolve_backend("auto") == "pallas" else "xla"


_LIMITS = {"gemv": (GEMV_MAX_ROWS, 1, GEMV_ROW_LIMIT), "gemm": (GEMM_MAX_ROWS, 2, GEMM_ROW_LIMIT)}


def _parse_part(spec: str, part: str):
    head, sep, names = part.partition(":")
    kind, at, rows = head.partition("@")
    if kind not in _LIMITS:
        raise ValueError(f"unknown projections {spec!r}: 'xla', or '+'-joined parts "
                         f"'gemv[@ROWS][:NAME,...]' and 'gemm[@ROWS][:NAME,...]' with NAME in "
                         f"{NAMES}")
    default, lo, hi = _LIMITS[kind]
    max_rows = default
    if at:
        if not rows.isdigit() or not lo <= int(rows) <= hi:
            raise ValueError(f"projections {spec!r}: ROWS after '{kind}@' must be {lo}..{hi}")
        max_rows = int(rows)
    if sep and not names:
        raise ValueError(f"unknown projection name(s) [] in {spec!r}: give NAME,... after ':' "
                         f"with NAME in {NAMES}, or leave out the ':'")
    chosen = tuple(n for n in names.split(",") if n) if names else NAMES
    bad = sorted(set(chosen) - set(NAMES))
    if bad or not chosen:
        raise ValueError(f"unknown projection name(s) {bad} in {spec!r}; choose from {NAMES}")
    return kind, tuple(n for n in NAMES if n in chosen), max_rows


# '+flow' parts: the gemv_flow kernel's stages per layer (projections.PallasGemv.flow)
FLOW_PARTS = {"flow": 3, "flow4": 4, "flow5": 5}
FLOW_NAME = {v: k for k, v in FLOW_PARTS.items()}


def parse(spec: str):
    """'xla' -> XLA(); 'gemv' -> all four through the GEMV for one-row calls; 'gemv@5' -> for
    calls of up to 5 rows; 'gemv:gate_up,down' (or 'gemv@5:...') -> only those; 'gemm[@N]' ->
    calls of 2..N rows (default GEMM_MAX_ROWS) through the skinny GEMM; 'gemv+gemm' -> both;
    '+norms' -> the norm prologue; '+pfN' -> every GEMV loads N chunks ahead (default: each
    projection's GEMV_TUNING); '+stream' -> the streaming GEMV kernel (STREAM_TUNING) for
    GEMV calls of up to STREAM_MAX_ROWS rows (not with '+pfN'; '+stream@N': up to N rows,
    with 'gemv@N' or more, e.g. 2 for pipelined speculation's 2-row calls);
    '+mgpu[:NAME,...]' -> the Mosaic GPU GEMV (MGPU_TUNING, jax >= 0.11, bf16/fp16) for
    those projections' one-row GEMV calls instead (default: the 'gemv' part's; e.g.
    'gemv+norms+stream+mgpu:down');
    '+flow' (with 'norms' and 'stream') -> a one-row layer's o, gate/up and down as one
    ticket-ordered kernel (pallas_kernels.gemv_flow; experimental, opt-in); '+flow4' -> the
    same with the next layer's qkv as a fourth stage (not after a loop's last layer);
    '+flow5' -> and that layer's decode attention as a fifth (flow_attention: the whole layer
    in one kernel; the decode kernel then merges its splits itself, as last_combine=1);
    '+graph' (with 'norms' and 'stream', all four names) -> a one-row loop's layers as one
    CUDA graph of the PDL launcher's own (ouro_jax.graph_loop; experimental, opt-in, a GPU
    with the `triton` package); '+inv[@LO-HI]' -> calls of LO..HI rows (default
    projections.INV_ROWS, 2-64) through the batch-invariant mode's GEMM and add_norm
    kernels (ouro_jax.invariant), before any other part's route; 'auto' -> see resolve."""
    from ouro_jax.projections import XLA, PallasGemv  # (they import this module's names)
    spec = resolve(spec)
    if spec in ("", "xla"):
        return XLA()
    parts = spec.split("+")
    inv_rows, parts = _inv_part(spec, parts)
    if not parts:
        raise ValueError(f"projections {spec!r}: 'inv' is a part joined to a 'gemv' or 'gemm' "
                         f"part, e.g. 'gemv+norms+stream+inv'")
    graph = "graph" in parts
    if graph:
        parts = [q for q in parts if q != "graph"]
    kinds = [p.partition(":")[0].partition("@")[0] for p in parts]
    mgpu_parts = [p for p, kind in zip(parts, kinds) if kind == "mgpu"]
    stream_rows, parts = _stream_part(spec, parts)
    fuse_norms, stream, prefetch, flow = _modes(spec, parts, kinds, mgpu_parts)
    kw = {}
    for part in (p for p in parts if p not in ("norms", "stream", *FLOW_PARTS)
                 and p not in mgpu_parts
                 and not p.startswith("pf")):
        kind, names, rows = _parse_part(spec, part)
        if kind in kw:
            raise ValueError(f"projections {spec!r}: '{kind}' given twice")
        kw[kind] = (names, rows)
    gemv_names, gemv_rows = kw.get("gemv", ((), GEMV_MAX_ROWS))
    gemm_names, gemm_rows = kw.get("gemm", ((), GEMM_MAX_ROWS))
    mgpu_names = _mgpu_names(spec, mgpu_parts, gemv_names)
    need = {"o", "gate_up", "down"} | ({"qkv"} if flow >= 4 else set())
    if flow and not need <= set(gemv_names):
        raise ValueError(f"projections {spec!r}: '{FLOW_NAME[flow]}' needs "
                         f"{sorted(need)} in the "
                         f"'gemv' part")
    if graph and (spec.split("+").count("graph") > 1 or not (fuse_norms and stream)
                  or flow or mgpu_names or prefetch is not None
                  or set(gemv_names) != set(NAMES) or gemv_rows < 1):
        raise ValueError(f"projections {spec!r}: 'graph' (a one-row loop's layers as one CUDA "
                         f"graph of our own) is given once, with 'gemv' for all of {NAMES}, "
                         f"'norms' and 'stream', and without 'flow', 'mgpu' or 'pfN'")
    if stream_rows != STREAM_MAX_ROWS and (flow or graph or mgpu_names or gemv_rows < stream_rows):
        raise ValueError(f"projections {spec!r}: 'stream@{stream_rows}' (the streaming GEMV "
                         f"for calls of up to {stream_rows} rows) needs a 'gemv@N' part with "
                         f"N >= {stream_rows}, and no 'flow', 'graph' or 'mgpu' (one-row "
                         f"routes)")
    return PallasGemv(gemv_names, gemv_rows, gemm_names, gemm_rows, fuse_norms, prefetch, stream,
                      mgpu_names, flow, graph, inv_rows, stream_rows)


def _stream_part(spec: str, parts: list) -> tuple:
    """('+stream@N''s N, else STREAM_MAX_ROWS; the parts with it written as 'stream')."""
    from pallas_kernels.gemv_stream import MAX_ROWS
    at = [p for p in parts if p.startswith("stream@")]
    if not at:
        return STREAM_MAX_ROWS, parts
    rows = at[0].partition("@")[2]
    if len(at) > 1 or not rows.isdigit() or not 1 <= int(rows) <= MAX_ROWS:
        raise ValueError(f"projections {spec!r}: 'stream@N' (the streaming GEMV for calls of "
                         f"up to N rows) is given once, with N in 1..{MAX_ROWS}")
    return int(rows), ["stream" if p == at[0] else p for p in parts]


def _inv_part(spec: str, parts: list) -> tuple:
    """('+inv[@LO-HI]''s (LO, HI) or (), the other parts)."""
    inv = [p for p in parts if p.partition("@")[0] == "inv"]
    if not inv:
        return (), parts
    lo, hi = INV_ROWS
    _, at, rows = inv[0].partition("@")
    if at:
        a, dash, b = rows.partition("-")
        ok = a.isdigit() and b.isdigit() and dash
        lo, hi = (int(a), int(b)) if ok else (0, 0)
    if len(inv) > 1 or not 2 <= lo <= hi <= GEMM_ROW_LIMIT:
        raise ValueError(f"projections {spec!r}: 'inv[@LO-HI]' (calls of LO..HI rows through "
                         f"the batch-invariant mode's kernels) is given once, with "
                         f"2 <= LO <= HI <= {GEMM_ROW_LIMIT}")
    return (lo, hi), [p for p in parts if p not in inv]


def _modes(spec: str, parts: list, kinds: list, mgpu_parts: list):
    """The spec's switches, checked: (norms, stream, the 'pfN' depth or None, the flow
    kernel's stages: 0, 3, 4 or 5)."""
    fuse_norms = "norms" in parts
    stream = "stream" in parts
    if parts.count("norms") > 1 or (fuse_norms and "gemv" not in kinds):
        raise ValueError(f"projections {spec!r}: 'norms' (RMSNorms and residual adds in the GEMV "
                         f"prologue) is given once, with a 'gemv' part")
    if parts.count("stream") > 1 or (stream and "gemv" not in kinds):
        raise ValueError(f"projections {spec!r}: 'stream' (the streaming GEMV kernel) is given "
                         f"once, with a 'gemv' part")
    pf = [p for p in parts if p.startswith("pf")]
    prefetch = None
    if pf:
        from pallas_kernels.gemv import MAX_PREFETCH
        if len(pf) > 1 or "gemv" not in kinds or not pf[0][2:].isdigit() \
                or int(pf[0][2:]) > MAX_PREFETCH:
            raise ValueError(f"projections {spec!r}: 'pfN' (the GEMV's prefetch depth, N in "
                             f"0..{MAX_PREFETCH}) is given once, with a 'gemv' part")
        prefetch = int(pf[0][2:])
        if stream:
            raise ValueError(f"projections {spec!r}: 'pfN' is the per-block GEMV's prefetch "
                             f"depth; with 'stream' one-row calls take the streaming kernel, "
                             f"which has none (give one of the two)")
    flows = [p for p in parts if p in FLOW_PARTS]
    flow = FLOW_PARTS[flows[0]] if flows else 0
    if flow and (len(flows) > 1 or not (fuse_norms and stream) or mgpu_parts):
        raise ValueError(f"projections {spec!r}: 'flow', 'flow4' or 'flow5' (o -> gate/up -> "
                         f"down [-> the next qkv [-> its attention]] of one-row calls in one "
                         f"gemv_flow kernel) is given once, with 'norms' and 'stream' and "
                         f"without 'mgpu'")
    if len(mgpu_parts) > 1 or (mgpu_parts and ("gemv" not in kinds or "@" in mgpu_parts[0])):
        raise ValueError(f"projections {spec!r}: 'mgpu[:NAME,...]' (the Mosaic GPU GEMV for "
                         f"one-row calls; no '@ROWS') is given once, with a 'gemv' part")
    from ouro_jax import projections  # mgpu_available looked up there: tests patch it
    if mgpu_parts and not projections.mgpu_available():
        raise ValueError(f"projections {spec!r}: 'mgpu' needs jax >= 0.11 with Mosaic GPU "
                         f"Pallas (jax.experimental.pallas.mosaic_gpu); this is jax "
                         f"{jax.__version__}")
    return fuse_norms, stream, prefetch, flow


def _mgpu_names(spec: str, mgpu_parts: list, gemv_names: tuple) -> tuple:
    """The projections an 'mgpu[:NAME,...]' part names (none: the 'gemv' part's)."""
    if not mgpu_parts:
        return ()
    if mgpu_parts == ["mgpu"]:
        return gemv_names
    _, mgpu_names, _ = _parse_part(spec, mgpu_parts[0].replace("mgpu", "gemv", 1))
    if set(mgpu_names) - set(gemv_names):
        raise ValueError(f"projections {spec!r}: 'mgpu' names {mgpu_names} must be among "
                         f"the 'gemv' part's {gemv_names} (it replaces their one-row "
                         f"kernel)")
    return mgpu_names


def auto_fit(proj, cfg):
    """projections='auto' for this model: GPU_DEFAULT's '+inv' is dropped for a model whose
    projection dims the GEMM cannot tile (invariant.check_model; the calls then take XLA's
    GEMMs, as before session 43), where an explicit '+inv' is refused."""
    if not getattr(proj, "inv_rows", ()):
        return proj
    from ouro_jax.invariant import check_model
    try:
        check_model(cfg)
    except ValueError:
        return dataclasses.replace(proj, inv_rows=())
    return proj
