"""Process-wide kernel tuning overrides for benchmark runs (`benchmarks.decode --decode-kernel
/ --ragged-kernel / --stream-tiling / --mgpu-tiling`): parsed, checked, set before anything compiles, and
cleared again afterwards."""

from __future__ import annotations

# last_combine=1: the decode kernel merges its splits itself (ouro_jax.attention.LAST_COMBINE)
# pdl=1: the decode kernel emits the PDL trigger (pallas_kernels._common.PDL); needs last_combine
# fuse_o=1: one-row decode runs pallas_kernels.attention_o (attention + o projection in one
# kernel; ouro_jax.attention.FUSE_O), with block_t / num_warps / num_stages and o_block_n /
# o_w_early / o_split (its split_keys) as its tuning; other batch sizes are unchanged
# mgpu=1: decode runs pallas_kernels.decode_mgpu_paged (Mosaic GPU, no splits; ouro_jax.
# attention.MGPU_DECODE), tiled by mgpu_block (positions per K/V block) and mgpu_stages
# skip_done=0: finished rows attend over their whole context, as before session 44
# (ouro_jax.attention.SKIP_DONE; any attention kernel, not only the decode kernel)
# o_merge=1: one-row decode leaves its split partials to the o projection's streaming GEMV,
# which merges them in its prologue (ouro_jax.attention.O_MERGE, pallas_kernels.gemv_merge)
DECODE_TUNING_KEYS = ("block_t", "num_splits", "num_warps", "num_stages", "last_combine", "pdl",
                      "fuse_o", "o_block_n", "o_w_early", "o_split", "flow_o",
                      "flow_o_block_n", "flow_o_per_program", "mgpu", "mgpu_block",
                      "mgpu_stages", "o_merge", "ragged_from", "skip_done")
RAGGED_TUNING_KEYS = ("block_q", "block_t", "num_splits", "num_warps", "num_stages", "direct")
BOOL_TUNING_KEYS = ("last_combine", "pdl", "fuse_o", "o_w_early", "o_split", "flow_o",
                    "mgpu", "o_merge", "direct", "skip_done")
# counts where 0 turns the feature off (ragged_from: decode batches of at least this many
# sequences take the ragged kernel, ouro_jax.attention.RAGGED_FROM)
ZERO_OFF_TUNING_KEYS = ("ragged_from",)
# tile sizes, Triton warps
POW2_TUNING_KEYS = ("block_q", "block_t", "num_warps", "o_block_n", "flow_o_block_n",
                    "mgpu_block")


def parse_tuning(spec: str, keys) -> dict:
    """'block_t=32,num_warps=2' -> {'block_t': 32, 'num_warps': 2}; unknown keys, non-positive
    integers and switches (BOOL_TUNING_KEYS) other than 0 or 1 are errors."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise SystemExit(f"kernel tuning: {item!r} is not KEY=INT with KEY in {keys}")
        try:
            out[key] = int(value)
        except ValueError:
            raise SystemExit(f"kernel tuning: {key} needs an integer, got {value!r}") from None
        if key in BOOL_TUNING_KEYS:
            if out[key] not in (0, 1):
                raise SystemExit(f"kernel tuning: {key} is 0 or 1, got {out[key]}")
            continue
        least = 0 if key in ZERO_OFF_TUNING_KEYS else 1
        if out[key] < least:
            raise SystemExit(f"kernel tuning: {key} must be >= {least}, got {out[key]}")
        if key in POW2_TUNING_KEYS and out[key] & (out[key] - 1):
            raise SystemExit(f"kernel tuning: {key} must be a power of two, got {out[key]}")
    return out


_STREAM_DEFAULTS = None  # projections.STREAM_TUNING as shipped, for restoring


def parse_stream_tiling(spec: str) -> dict:
    """'qkv=st1_k512_p1_w4,o=...' -> {projection: tiling} from benchmarks.gemv.STREAM_VARIANTS.
    A tiling must divide the 1.4B/2.6B projection shape it is given for: the engine would
    otherwise shrink it to fit (projections.fit_stream_tuning) and the run would not be the
    tiling the record names."""
    from benchmarks.gemv import SHAPES, STREAM_VARIANTS
    from ouro_jax.projections import NAMES
    from pallas_kernels.gemv_stream import check_supported
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, variant = item.partition("=")
        if not sep or name not in NAMES or variant not in STREAM_VARIANTS:
            raise SystemExit(f"--stream-tiling: {item!r} is not NAME=VARIANT with NAME in "
                             f"{NAMES} and VARIANT a benchmarks.gemv STREAM_VARIANTS key")
        t = STREAM_VARIANTS[variant]
        n, k, gated = SHAPES[name]
        try:  # one row: the engine's streaming calls
            check_supported(1, k, n // 2 if gated else n, **t)
        except ValueError as e:
            raise SystemExit(f"--stream-tiling: {variant} does not fit the {name} projection "
                             f"({n} x {k}): {e}") from None
        out[name] = dict(t)
    return out


_MGPU_DEFAULTS = None  # projections.MGPU_TUNING as shipped, for restoring
_INVARIANT_DEFAULTS = None  # (invariant.TUNING, invariant.ROUTES) as shipped, for restoring


def parse_invariant_tiling(spec: str) -> tuple[dict, dict]:
    """'qkv=16:mm16_n64_k128_w4_s4/mm64_n128_k128_w8_s3,o=mm64_n64_k128_w4_s4_x4' ->
    ({weight: GEMM tiling}, {weight: routes}) for the batch-invariant mode
    (ouro_jax.invariant.TUNING and ROUTES; weights qkv, o, gate_up, down, head), tilings from
    benchmarks.gemv.GEMM_VARIANTS. A weight's items, separated by '/', are ROWS:VARIANT
    routes in increasing ROWS (calls of at most ROWS rows take that tile) and at most one
    plain VARIANT, last, for every other row count (left out: the shipped tiling). A weight
    named here runs exactly what is given: no route given, none runs. A route must keep its
    weight's K steps (block_k, k_splits), and every tiling must fit the 1.4B/2.6B weight as
    it is (the engine would otherwise shrink it, and the record would not name what ran)."""
    from ouro_jax.invariant import NAMES, ROUTE_KEYS, TUNING
    shipped = TUNING if _INVARIANT_DEFAULTS is None else _INVARIANT_DEFAULTS[0]
    tilings, routes = {}, {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise SystemExit(f"--invariant-tiling: {item!r} is not NAME=VARIANT")
        if name not in NAMES:
            raise SystemExit(f"--invariant-tiling: unknown weight {name!r}; one of {NAMES}")
        if name in tilings:
            raise SystemExit(f"--invariant-tiling: {name} is given twice")
        parts = [p.strip() for p in value.split("/")]
        plain = [p for p in parts if ":" not in p]
        if len(plain) > 1 or (plain and parts[-1] != plain[0]):
            raise SystemExit(f"--invariant-tiling: {name}: at most one plain VARIANT, last "
                             f"(the others ROWS:VARIANT), got {value!r}")
        tilings[name] = _invariant_variant(name, plain[0]) if plain else dict(shipped[name])
        reduction = {k: tilings[name].get(k, 1) for k in ("block_k", "k_splits")}
        out, last = [], 0
        for part in parts[:len(parts) - len(plain)]:
            rows, _, variant = part.partition(":")
            if not rows.strip().isdigit() or int(rows) <= last:
                raise SystemExit(f"--invariant-tiling: {name}: route rows must be increasing "
                                 f"positive integers, got {part!r}")
            t = _invariant_variant(name, variant.strip())
            if {k: t.get(k, 1) for k in reduction} != reduction:
                raise SystemExit(f"--invariant-tiling: {name}: route {part!r} changes the K "
                                 f"steps ({reduction} for this weight): a route may change "
                                 f"only {', '.join(ROUTE_KEYS)}")
            last = int(rows)
            out.append((last, {k: t[k] for k in ROUTE_KEYS}))
        routes[name] = tuple(out)
    return tilings, routes


def _invariant_variant(name: str, variant: str) -> dict:
    """A GEMM_VARIANTS tiling, checked against the 1.4B weight `name` as it is."""
    from benchmarks.gemm_tilings import GEMM_VARIANTS
    from benchmarks.gemv import SHAPES
    from ouro_jax.config import PRESETS
    from pallas_kernels.gemm import check_supported
    if variant not in GEMM_VARIANTS:
        raise SystemExit(f"--invariant-tiling: {variant!r} is not a benchmarks.gemv "
                         f"GEMM_VARIANTS key")
    cfg = PRESETS["1.4b"]  # the LM head: vocabulary x hidden
    n, k, gated = dict(SHAPES, head=(cfg.vocab_size, cfg.hidden_size, False))[name]
    t = GEMM_VARIANTS[variant]
    try:
        check_supported(1, k, n // 2 if gated else n, block_m=t["block_m"],
                        block_n=t["block_n"], block_k=t["block_k"],
                        k_splits=t.get("k_splits", 1))
    except ValueError as e:
        raise SystemExit(f"--invariant-tiling: {variant} does not fit {name} ({n} x {k}): "
                         f"{e}") from None
    return dict(t)


def parse_mgpu_tiling(spec: str) -> dict:
    """'down=bn64_bk64_ks8_st4,qkv=bn64_bk128_ks1_st4_ov' -> {projection: (block_n, block_k,
    k_splits, stages, overlap)} for the Mosaic GPU GEMV ('+mgpu'). Checked against the
    1.4B/2.6B projection shapes as the engine calls them (qkv and gate/up with the norm
    prologue): a tiling the kernel would refuse, or one the engine would shrink
    (projections.fit_mgpu_tuning), is an error naming it."""
    import re

    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import NAMES, fit_mgpu_tuning, mgpu_available
    items = list(filter(None, (x.strip() for x in spec.split(","))))
    if not items:
        return {}
    if not mgpu_available():
        raise SystemExit("--mgpu-tiling: the Mosaic GPU GEMV needs jax >= 0.11")
    import jax
    import jax.numpy as jnp
    from pallas_kernels.gemv_mgpu_normed import check_tiling
    bf = jnp.bfloat16
    out = {}
    for item in items:
        name, sep, tiling = item.partition("=")
        m = re.fullmatch(r"bn([1-9]\d*)_bk([1-9]\d*)_ks([1-9]\d*)_st([1-9]\d*)(_ov)?", tiling)
        if not sep or name not in NAMES or not m:
            raise SystemExit(f"--mgpu-tiling: {item!r} is not NAME=bnN_bkN_ksN_stN[_ov] with "
                             f"NAME in {NAMES} and positive integers N")
        if name in out:
            raise SystemExit(f"--mgpu-tiling: {name} is given twice")
        t = tuple(int(v) for v in m.groups()[:4]) + (m.group(5) is not None,)
        n, k, gated = SHAPES[name]
        n_out, normed = (n // 2 if gated else n), name in ("qkv", "gate_up")
        try:  # the engine's normed calls take the add_norm prologue (x' in SMEM too)
            check_tiling(jax.ShapeDtypeStruct((1, k), bf), jax.ShapeDtypeStruct((n_out, k), bf),
                         *t[:4], gated, normed, normed)
            fitted = fit_mgpu_tuning(name, t, n_out, k, bf, normed)
            if tuple(fitted.values()) != t:
                raise ValueError(f"the engine would run it as {fitted}")
        except ValueError as e:
            raise SystemExit(f"--mgpu-tiling: {tiling} does not fit the {name} projection "
                             f"({n} x {k}): {e}") from None
        out[name] = t
    return out


def parse_pdl(spec: str) -> tuple:
    """'qkv,o,gate_up' -> the streaming projections whose GEMV emits the PDL trigger
    (gemv_stream's pdl). 'down' is refused: after the last layer its next kernel can be an
    XLA fusion (the final norm), which must not be launched early (pallas_kernels._common.PDL);
    the decode kernel's trigger is --decode-kernel pdl=1."""
    from ouro_jax.projections import NAMES
    names = tuple(filter(None, (x.strip() for x in spec.split(","))))
    for name in names:
        if name not in NAMES or name == "down":
            allowed = tuple(n for n in NAMES if n != "down")
            raise SystemExit(f"--pdl: {name!r} is not one of {allowed} (down's next kernel "
                             "may be an XLA fusion)")
    return names


def parse_l2(spec: str, option: str, allow_all: bool) -> dict:
    """'qkv=3,gate_up=all' -> {projection: int} for --l2-prefetch (the streaming GEMV's own
    later blocks, 'all' = every one: per_program - 1) or --l2-next (rows per program of the
    next projection's weight). Unknown names, repeats and negative or non-integer counts are
    errors."""
    from ouro_jax.projections import NAMES
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in NAMES or name in out:
            raise SystemExit(f"{option}: {item!r} is not NAME=COUNT with NAME one of {NAMES} "
                             "(each at most once)")
        if allow_all and value == "all":
            out[name] = -1
            continue
        if not (value.isascii() and value.isdigit()):
            raise SystemExit(f"{option}: {name} needs a count >= 0"
                             + (" or 'all'" if allow_all else "") + f", got {value!r}")
        out[name] = int(value)
    return out


def add_stream_args(p) -> None:
    """The streaming GEMV's experimental switches, shared by benchmarks.decode and
    benchmarks.kernel_trace (applied by apply_kernel_tuning)."""
    p.add_argument("--l2-prefetch", default="", metavar="NAME=N,...",
                   help="streaming projections whose GEMV programs prefetch N of their later "
                        "weight blocks into L2 at their start ('all': every one), e.g. "
                        "qkv=all,gate_up=all")
    p.add_argument("--l2-next", default="", metavar="NAME=ROWS,...",
                   help="streaming projections whose GEMV programs prefetch ROWS rows each of "
                        "the next projection's weight into L2 (qkv->o, o->gate/up, "
                        "gate/up->down, down->next layer's qkv), e.g. o=2,down=3")
    p.add_argument("--l2-next-at", default="end", choices=["start", "end"],
                   help="when --l2-next's prefetch is issued: at the program's start, or once "
                        "its last weight block is requested")
    p.add_argument("--graph-pdl", default="start", choices=["start", "end"],
                   help="with --projections ...+graph: where each graphed GEMV triggers the "
                        "next kernel's launch, at its start (default) or once its last "
                        "weight block is requested (ouro_jax.graph_loop.KERNEL_PDL)")
    p.add_argument("--stream-set", default="", metavar="NAME.KEY=0|1,...",
                   help="streaming GEMV switches per projection, e.g. qkv.x_first=1 (x and "
                        "the branch read before the first weight block), "
                        "gate_up.defer_norm=1 (the norm's scale applied to the outputs: "
                        "another rounding, so speculative tokens stop equalling native ones)")


def check_graph_pdl(args) -> None:
    """--graph-pdl end changes only the '+graph' projections' kernels: say so rather than
    record a default run under its name."""
    if args.graph_pdl != "start" and "graph" not in args.projections.split("+"):
        raise SystemExit("--graph-pdl sets the '+graph' loops' triggers: give --projections "
                         "with a 'graph' part (e.g. gemv+norms+stream+graph), or leave it out")


STREAM_SWITCHES = ("x_first", "defer_norm", "row2d", "fold_sums", "evict_first")  # gemv_stream bool keys


def parse_stream_set(spec: str) -> dict:
    """'qkv.x_first=1,gate_up.x_first=0' -> {projection: {key: bool}} for --stream-set."""
    from ouro_jax.projections import NAMES
    out: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        lhs, sep, value = item.partition("=")
        name, dot, key = lhs.partition(".")
        if not (sep and dot) or name not in NAMES or key not in STREAM_SWITCHES \
                or value not in ("0", "1") or key in out.get(name, {}):
            raise SystemExit(f"--stream-set: {item!r} is not NAME.KEY=0|1 with NAME in {NAMES} "
                             f"and KEY in {STREAM_SWITCHES} (each at most once)")
        out.setdefault(name, {})[key] = value == "1"
    return out


def _check_decode_tuning(d: dict) -> None:
    """Refuses --decode-kernel combinations that name no kernel the engine has."""
    if d.get("flow_o") and (d.get("fuse_o") or d.get("pdl")):
        raise SystemExit("--decode-kernel flow_o=1 ([attention, o] as one gemv_flow) takes "
                         "neither fuse_o nor pdl")
    if d.get("pdl") and not d.get("last_combine"):
        raise SystemExit("--decode-kernel pdl=1 needs last_combine=1 (the kernel's next kernel "
                         "must be the o projection's GEMV, not the XLA split combine)")
    if d.get("fuse_o") and (d.get("last_combine") or d.get("pdl")):
        raise SystemExit("--decode-kernel fuse_o=1 replaces the one-row decode kernel, whose "
                         "last_combine / pdl it cannot take: set one or the other")
    if not d.get("fuse_o") and {"o_block_n", "o_w_early", "o_split"} & set(d):
        raise SystemExit("--decode-kernel o_block_n / o_w_early / o_split tune the fused "
                         "attention + o kernel: they need fuse_o=1")
    if not d.get("flow_o") and {"flow_o_block_n", "flow_o_per_program"} & set(d):
        raise SystemExit("--decode-kernel flow_o_block_n / flow_o_per_program tile the o "
                         "stage of flow_o=1: they need flow_o=1")
    if d.get("mgpu") and {"last_combine", "pdl", "fuse_o", "flow_o"} & {k for k, v in d.items()
                                                                        if v}:
        raise SystemExit("--decode-kernel mgpu=1 replaces the Triton decode kernel (Mosaic "
                         "GPU, no splits): it takes none of last_combine, pdl, fuse_o, flow_o")
    if not d.get("mgpu") and {"mgpu_block", "mgpu_stages"} & set(d):
        raise SystemExit("--decode-kernel mgpu_block / mgpu_stages tile the Mosaic GPU decode "
                         "kernel: they need mgpu=1")


def apply_kernel_tuning(decode_spec: str, ragged_spec: str, stream_spec: str = "",
                        pdl_spec: str = "", pdl_at: str = "start", mgpu_spec: str = "",
                        l2_spec: str = "", l2_next_spec: str = "",
                        l2_next_at: str = "end", stream_set: str = "",
                        graph_pdl: str = "start", invariant_spec: str = "") -> dict:
    """Sets the kernels' process-wide tuning overrides (before anything is compiled). Every
    spec is parsed before anything is set, so a bad one changes nothing."""
    import importlib

    from ouro_jax import projections
    global _STREAM_DEFAULTS
    invariant_tilings, routes = parse_invariant_tiling(invariant_spec)
    tuning = {"decode": parse_tuning(decode_spec, DECODE_TUNING_KEYS),
              "ragged": parse_tuning(ragged_spec, RAGGED_TUNING_KEYS),
              "stream": parse_stream_tiling(stream_spec), "pdl": parse_pdl(pdl_spec),
              "mgpu": parse_mgpu_tiling(mgpu_spec),
              "l2_prefetch": parse_l2(l2_spec, "--l2-prefetch", True),
              "l2_next": parse_l2(l2_next_spec, "--l2-next", False),
              "stream_set": parse_stream_set(stream_set),
              "invariant": invariant_tilings}
    if any(routes.values()):  # (the record names the routes that ran)
        tuning["invariant_routes"] = {k: [list(r) for r in v] for k, v in routes.items()}
    if l2_next_at not in ("start", "end"):
        raise SystemExit(f"--l2-next-at is start or end, got {l2_next_at!r}")
    if pdl_at not in ("start", "end"):
        raise SystemExit(f"--pdl-at is start or end, got {pdl_at!r}")
    if graph_pdl not in ("start", "end"):
        raise SystemExit(f"--graph-pdl is start or end, got {graph_pdl!r}")
    _check_decode_tuning(tuning["decode"])
    importlib.import_module("ouro_jax.graph_loop").KERNEL_PDL = graph_pdl
    if graph_pdl != "start":  # (the record names it where it is not the shipped mode)
        tuning["graph_pdl"] = graph_pdl
    for name in ("decode", "ragged"):
        mod = importlib.import_module(f"pallas_kernels.{name}")
        mod.TUNING.clear()
        mod.TUNING.update(tuning[name])
    if _STREAM_DEFAULTS is None:
        _STREAM_DEFAULTS = {k: dict(v) for k, v in projections.STREAM_TUNING.items()}
    projections.STREAM_TUNING.clear()
    projections.STREAM_TUNING.update({k: dict(v) for k, v in _STREAM_DEFAULTS.items()})
    for name, tiling in tuning["stream"].items():  # a tiling keeps the shipped load policy
        keep = {k: v for k, v in _STREAM_DEFAULTS[name].items() if k == "evict_first"}
        tuning["stream"][name] = dict(tiling, **keep)  # (the record names what runs)
        projections.STREAM_TUNING[name] = dict(tuning["stream"][name])
    for name in tuning["pdl"]:
        projections.STREAM_TUNING[name]["pdl"] = pdl_at
    for name, blocks in tuning["l2_prefetch"].items():
        t = projections.STREAM_TUNING[name]
        t["l2_prefetch"] = t["per_program"] - 1 if blocks < 0 else blocks
    for name, rows in tuning["l2_next"].items():
        projections.STREAM_TUNING[name].update(next_rows=rows, next_at=l2_next_at)
    for name, switches in tuning["stream_set"].items():
        projections.STREAM_TUNING[name].update(switches)
    _apply_tables(tuning, routes)
    return tuning


def _apply_tables(tuning: dict, routes: dict) -> None:
    """The Mosaic GPU GEMV's and the batch-invariant mode's tilings: the shipped ones (kept
    from the first call) with this run's overrides."""
    from ouro_jax import invariant, projections
    global _MGPU_DEFAULTS, _INVARIANT_DEFAULTS
    if _MGPU_DEFAULTS is None:
        _MGPU_DEFAULTS = dict(projections.MGPU_TUNING)
    projections.MGPU_TUNING.clear()
    projections.MGPU_TUNING.update(_MGPU_DEFAULTS, **tuning["mgpu"])
    if _INVARIANT_DEFAULTS is None:
        _INVARIANT_DEFAULTS = ({k: dict(v) for k, v in invariant.TUNING.items()},
                               dict(invariant.ROUTES))
    invariant.TUNING.clear()
    invariant.TUNING.update({k: dict(v) for k, v in _INVARIANT_DEFAULTS[0].items()},
                            **tuning["invariant"])
    invariant.ROUTES.clear()
    invariant.ROUTES.update(_INVARIANT_DEFAULTS[1], **routes)


def block_stage_tilings(spec: str) -> list[tuple[int, int]]:
    """'128:2,64:4' -> [(128, 2), (64, 4)]: the Mosaic decode kernels' K/V block and stages."""
    try:
        return [tuple(map(int, t.split(":"))) for t in spec.split(",") if t]
    except ValueError:
        raise SystemExit(f"--tilings: {spec!r} is not BLOCK:STAGES,...") from None
