"""The checks Ouro's constructor and generate run on their arguments before any work: each
refuses a bad value by name, as a ValueError."""

from __future__ import annotations

from ouro_jax.kv_cache import pages_needed
from ouro_jax.model import ExitSpec
from ouro_jax.sampling import as_int

MAX_DECODE_CHUNK = 4096  # decode_chunk's bound where a model's positions are fewer


def checked_exit(cfg, exit_at_step, exit_threshold, weighted_exit) -> ExitSpec:
    """The exit options as an ExitSpec. ExitSpec keeps the reference's priority (a step wins
    over a threshold, a threshold over weighting); here two of them together are refused,
    as the CLI does, rather than one silently ignored."""
    spec = ExitSpec(exit_at_step, exit_threshold, weighted_exit).validate(cfg)
    given = [name for name, on in (("exit_at_step", spec.exit_at_step is not None),
                                   ("exit_threshold", spec.threshold is not None),
                                   ("weighted_exit", spec.weighted)) if on]
    if len(given) > 1:
        raise ValueError(f"give at most one of exit_at_step, exit_threshold and weighted_exit; "
                         f"got {' and '.join(given)}")
    return spec


def checked_sizes(cfg, page_size, prefill_chunk, decode_chunk, kv_pool_tokens):
    """The engine's sizes as ints, each refused by name unless a positive device int32."""
    sizes = tuple(as_int(v, name) for v, name in ((page_size, "page_size"),
                                                  (prefill_chunk, "prefill_chunk"),
                                                  (decode_chunk, "decode_chunk")))
    for name, v in zip(("page_size", "prefill_chunk", "decode_chunk"), sizes):
        if not 1 <= v < 2**31:  # (device int32 values)
            raise ValueError(f"{name} must be a positive integer below 2**31, got {v}")
    if sizes[2] > max(cfg.max_position_embeddings, MAX_DECODE_CHUNK):
        # (its output buffers are decode_chunk steps long, whatever max_tokens is)
        raise ValueError(f"decode_chunk {sizes[2]} is more steps than any request can "
                         f"decode (max_position_embeddings {cfg.max_position_embeddings})")
    if kv_pool_tokens is not None:
        n = as_int(kv_pool_tokens, "kv_pool_tokens")
        # page ids are device int32s (and a pool that large could never be allocated)
        if n < 1 or pages_needed(n, sizes[0]) >= 2**31 - 2:
            raise ValueError(f"kv_pool_tokens must be a positive number of tokens under "
                             f"{(2**31 - 2) * sizes[0]:,} (int32 page ids of {sizes[0]} tokens), "
                             f"got {kv_pool_tokens!r}")
    return sizes


def check_flags(**flags) -> None:
    """Ouro's switches must be Python bools (a string such as "no" would read as True)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")


def check_layer_kernels(projections, attention, proj, resolved: str, kv_xla: bool,
                         persistent_layers: bool) -> None:
    """Refuses the layer-kernel paths that run the Pallas decode attention (with its RoPE and
    K/V write) inside a kernel of their own where that attention is not the one in use."""
    fused_attention = resolved == "pallas" and not kv_xla
    if getattr(proj, "flow", 0) == 5 and not fused_attention:
        raise ValueError(
            f"projections {projections!r}: '+flow5' runs the Pallas decode attention (with "
            f"its RoPE and K/V write) inside the layer kernel, so it needs "
            f"attention='pallas' (got {attention!r}, i.e. {resolved!r}), fused_kv_write and "
            f"fuse_projections (the fused qkv weight); use '+flow4' otherwise")
    if getattr(proj, "graph", False):  # batch-1 decode loops as CUDA graphs of our own
        if not fused_attention:
            raise ValueError(
                f"projections {projections!r}: '+graph' runs the Pallas decode attention "
                f"(with its RoPE and K/V write) in each loop's graph, so it needs "
                f"attention='pallas' (got {attention!r}, i.e. {resolved!r}), "
                f"fused_kv_write and fuse_projections")
        from ouro_jax import graph_loop
        graph_loop.check_available()
    if persistent_layers and not fused_attention:
        raise ValueError(f"persistent_layers runs the decode attention (its RoPE and "
                         f"K/V write) inside the layer kernel: it needs "
                         f"attention='pallas' (got {attention!r}, i.e. {resolved!r}), "
                         f"fused_kv_write and fuse_projections")


def check_invariant(cfg, attention: str, projections: str, persistent_layers: bool,
                    fuse_projections: bool):
    """batch_invariant's settings (ouro_jax.invariant) as (attention, projections): the Pallas
    attention and the mode's own projections. Other kernel choices are refused by name, not
    overridden: they would be silently not taken."""
    from ouro_jax.invariant import check_model
    if attention not in ("auto", "pallas"):
        raise ValueError(f"batch_invariant runs the Pallas ragged attention kernel; got "
                         f"attention={attention!r} (give 'pallas' or leave 'auto')")
    if projections != "auto":
        raise ValueError(f"batch_invariant runs every projection through its own Pallas GEMM; "
                         f"got projections={projections!r} (leave 'auto')")
    if persistent_layers:
        raise ValueError("batch_invariant and persistent_layers exclude each other (the "
                         "persistent kernel is a one-row decode path)")
    if not fuse_projections:
        raise ValueError("batch_invariant needs fuse_projections=True (the unfused layer "
                         "runs its MLP as XLA dots)")
    check_model(cfg)
    return "pallas", "xla"
