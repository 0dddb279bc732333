"""The skinny GEMM's tilings for benchmarks.gemv (GEMM_VARIANTS, FEW_ROW_VARIANTS) and the
batch-invariant mode's pick among them (`python -m benchmarks.gemv --pick-invariant`)."""

from __future__ import annotations

# GEMM tilings with more programs for few-row calls (--fixed-rows: the batch-invariant mode
# runs 88-128 programs per projection at GEMM_TUNING's tiles on a card of 132 SMs,
# docs/performance.md): smaller tiles, and split-K (its partials summed in a fixed order).
# (block_m, block_n, block_k, warps, stages, k_splits); down's K = 5632 is 44 blocks of 128.
FEW_ROW_TILINGS = [
    (64, 16, 128, 4, 4, 1), (32, 16, 256, 4, 4, 1), (16, 16, 256, 4, 4, 1),
    (16, 16, 512, 4, 3, 1), (32, 32, 128, 4, 4, 1),
    (16, 16, 256, 4, 4, 2), (16, 16, 128, 4, 4, 4), (16, 32, 256, 4, 4, 2),
    (16, 32, 128, 4, 4, 4), (16, 64, 128, 4, 4, 4), (32, 16, 128, 4, 4, 4),
    (64, 16, 128, 4, 4, 4), (64, 64, 128, 4, 4, 4), (64, 32, 128, 4, 4, 4)]


def _key(bm, bn, bk, w, st, sp=1) -> str:
    """A tiling's GEMM_VARIANTS key: "mm" + block_m, block_n, block_k, warps, stages, and
    "_x" + k_splits where K is split."""
    return f"mm{bm}_n{bn}_k{bk}_w{w}_s{st}" + (f"_x{sp}" if sp > 1 else "")


FEW_ROW_VARIANTS = [_key(*t) for t in FEW_ROW_TILINGS]

# Tiles for the batch-invariant mode's row-count routes (ouro_jax.invariant.ROUTES): each
# keeps its weight's K steps (block_k 128; o and down split K in 4, qkv and gate/up not) and
# changes only the rows and columns per program, the warps and the stages. 16-row tiles for
# one-row calls; wider ones for the verification's k+1 rows per sequence (320 at batch 64,
# where session 41's trace had the mode's GEMMs at 2.1x the default's cuBLAS and XLA GEMMs:
# 148.5 against 70.5 us per layer application, kernel_trace_*_b64_k4_session41_h100.json)
# and for the prefill.
ROUTE_TILES = [(16, 32), (16, 64), (64, 128), (128, 64), (128, 128), (64, 256)]
ROUTE_TILINGS = [
    (bm, bn, 128, w, st, sp) for sp in (1, 4) for bm, bn in ROUTE_TILES
    for w, st in (((4, 4),) if bm == 16 else ((4, 4), (8, 3)))]
ROUTE_VARIANTS = {sp: [_key(*t) for t in ROUTE_TILINGS if t[5] == sp] + [
    _key(64, 64, 128, 4, 4, sp)] for sp in (1, 4)}

# Skinny GEMM (pallas_kernels/gemm.py) tilings for batched decode (M = 8-512 rows)
GEMM_VARIANTS = {
    _key(bm, bn, bk, w, st, sp): dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                      num_stages=st, **(dict(k_splits=sp) if sp > 1 else {}))
    for bm, bn, bk, w, st, sp in [
        (64, 64, 128, 4, 4, 1), (64, 32, 128, 4, 4, 1), (64, 128, 64, 4, 4, 1),
        (64, 64, 64, 4, 5, 1), (64, 64, 256, 4, 3, 1), (64, 32, 256, 4, 3, 1),
        (64, 128, 128, 8, 3, 1), (64, 64, 128, 8, 4, 1), (64, 16, 256, 4, 4, 1),
        (128, 64, 128, 8, 3, 1), (64, 32, 64, 4, 6, 1), (32, 64, 128, 4, 4, 1),
        *FEW_ROW_TILINGS, *ROUTE_TILINGS]
}


def pick_invariant(results: list, max_rel_err: float = 1e-2) -> str:
    """The batch-invariant mode's GEMM tiling per weight (one tile at every row count, as
    before session 42's routes) from --fixed-rows runs, as a
    benchmarks.decode --invariant-tiling spec naming every measured weight (the LM head
    takes qkv's: the same K, the widest N). A pick is one tiling per weight at every row
    count, so a candidate is a tiling with a good result (no error, within max_rel_err of
    XLA) at every row count the runs measured; each is scored by its time relative to the
    best candidate's at each row count, summed. 'invariant' (the tiling the mode ran) is a
    candidate too, named in the spec by its GEMM_VARIANTS key, where the mode ran one tiling
    at every measured row count (with ROUTES it runs several: then it is no candidate, and
    pick_routes is the picker)."""
    time_of = lambda r: r["device_us"] if "device_us" in r else r["us"]  # noqa: E731
    ok = [r for r in results if r.get("fixed_rows") and "us" in r and "error" not in r
          and r["impl"] != "xla" and r.get("rel_err_vs_xla", 1.0) < max_rel_err]
    mixed = {s for s in {r["shape"] for r in ok if r["impl"] == "invariant"}
             if len({_variant_key(s, "invariant", r["rows"]) for r in results
                     if r["shape"] == s}) > 1}
    ok = [r for r in ok if not (r["impl"] == "invariant" and r["shape"] in mixed)]
    picks = {}
    for shape in sorted({r["shape"] for r in ok}):
        rows = sorted({r["rows"] for r in results if r["shape"] == shape})
        t = {(r["impl"], r["rows"]): time_of(r) for r in ok if r["shape"] == shape}
        complete = sorted(i for i in {i for i, _ in t} if all((i, m) in t for m in rows))
        if not complete:
            continue
        best = {m: min(t[i, m] for i in complete) for m in rows}
        picks[shape] = min(complete, key=lambda i: sum(t[i, m] / best[m] for m in rows))
    if "qkv" in picks:
        picks["head"] = picks["qkv"]
    return ",".join(f"{s}={_variant_key(s, v)}" for s, v in sorted(picks.items()))


def _variant_key(shape: str, impl: str, rows: int | None = None) -> str:
    """'invariant' -> the GEMM_VARIANTS key of the tiling the mode runs for that weight (at
    `rows` rows: its route there, if one is shipped; TUNING's without `rows`)."""
    if impl != "invariant":
        return impl
    from ouro_jax.invariant import TUNING, tiling_for
    ran = TUNING[shape] if rows is None else tiling_for(shape, rows)
    want = dict(ran, k_splits=ran.get("k_splits", 1))
    for key, tiling in GEMM_VARIANTS.items():
        if dict(tiling, k_splits=tiling.get("k_splits", 1)) == want:
            return key
    raise SystemExit(f"--pick-invariant: the mode's {shape} tiling {TUNING[shape]} is no "
                     f"GEMM_VARIANTS key; add it there")


def pick_routes(results: list, bits: list, max_rel_err: float = 1e-2,
                slack: float = 0.03) -> str:
    """The batch-invariant mode's row-count routes per weight (ouro_jax.invariant.ROUTES)
    from --fixed-rows runs at several row counts and a benchmarks.gemm_tiling_bits probe,
    as a --invariant-tiling spec ('o=8:mm16_..._x4/mm64_..._x4,...'). A candidate at a row
    count ran without error, agrees with XLA, keeps the weight's K steps (TUNING's block_k
    and k_splits) and, unless it is TUNING's own tiling, differed from it in no element at
    any row count the probe tried. From the most rows down, a row count keeps the tile of
    the band above it while that tile is within `slack` of the fastest there, else it opens
    a band (ROWS:VARIANT: calls of at most ROWS rows) of its own; the fastest tile at the
    most rows measured becomes the plain VARIANT, for the calls no band takes. Weights with
    no measurement are not named."""
    from ouro_jax.invariant import TUNING
    time_of = lambda r: r["device_us"] if "device_us" in r else r["us"]  # noqa: E731
    clean = {(b["shape"], b["variant"]) for b in bits
             if "error" not in b and not any(b.get("differing", {"": 1}).values())}
    specs = []
    for shape in sorted({r["shape"] for r in results} & set(TUNING)):
        steps = (TUNING[shape]["block_k"], TUNING[shape].get("k_splits", 1))
        t = {}
        for r in results:
            if r["shape"] != shape or r["impl"] == "xla" or "us" not in r or "error" in r \
                    or not r.get("fixed_rows") or r.get("rel_err_vs_xla", 1.0) >= max_rel_err:
                continue  # (without --fixed-rows the GEMM cuts block_m to the row count)
            key = _variant_key(shape, r["impl"], r["rows"])
            tiling = GEMM_VARIANTS[key]
            own = dict(tiling, k_splits=tiling.get("k_splits", 1)) == \
                dict(TUNING[shape], k_splits=steps[1])
            if (tiling["block_k"], tiling.get("k_splits", 1)) == steps and (
                    own or (shape, key) in clean):
                t[key, r["rows"]] = time_of(r)
        rows = sorted({m for _, m in t}, reverse=True)
        if not rows:
            continue
        fastest = {m: min((us, k) for (k, mm), us in t.items() if mm == m)[1] for m in rows}
        current, bands = fastest[rows[0]], []
        for m in rows[1:]:
            if (current, m) not in t or t[current, m] > (1 + slack) * t[fastest[m], m]:
                current = fastest[m]
                bands.append(f"{m}:{current}")  # rows up to m; above, the band before
        specs.append(f"{shape}=" + "/".join(bands[::-1] + [fastest[rows[0]]]))
    return ",".join(specs)
