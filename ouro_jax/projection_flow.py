"""The gemv_flow kernel's stages as the engine builds them ('+flow' / '+flow4' / '+flow5',
projections.PallasGemv.mlp_flow): the warp count and each stage's tiling. Split from
ouro_jax.projections, which re-exports these names."""

from __future__ import annotations

from ouro_jax.projection_tuning import STREAM_TUNING, fit_stream_tuning


# One kernel has one warp count: gemv_flow runs at the 4 warps it was measured with
# (sessions 21-24), whatever the separate GEMVs' STREAM_TUNING gives each projection (since
# session 31 qkv and gate/up run at 8). Its stages take the block sizes of STREAM_TUNING
# (flow_tiling). On a GPU the warp count also orders a block's partial sums, so the flow's
# bits equal the separate kernels' only where both run at the same warps (the CPU
# interpreter's tests do not see warps); against the 8-warp qkv and gate/up not measured.
FLOW_NUM_WARPS = 4


def flow_tiling(name: str, n_out: int, k: int, **override) -> dict:
    """A gemv_flow stage's tiling (gemv_flow.TILING_KEYS): the streaming GEMV's STREAM_TUNING
    for `name` with `override` on top, fitted to an [n_out, k] weight."""
    from pallas_kernels.gemv_flow import TILING_KEYS
    t = fit_stream_tuning(dict(STREAM_TUNING[name], **override), n_out, k)
    return {key: t[key] for key in TILING_KEYS}


def _flow_stages(lp, next_lp=None, attention=None) -> list:
    """gemv_flow's stages (mlp_stages) for a layer's o -> gate/up -> down with STREAM_TUNING's
    tilings fitted to the shapes, and with next_lp the next layer's qkv, whose prologue adds
    down's output (post_attention_layernorm_2) to the residual and norms it (next
    input_layernorm), and with `attention` (an AttnStage) that layer's decode attention."""
    from pallas_kernels.gemv_flow import mlp_stages
    weights = dict(o=(lp.o_proj, 1), gate_up=(lp.gate_up_proj, 2), down=(lp.down_proj, 1))
    if next_lp is not None:
        weights["qkv"] = (next_lp.qkv_proj, 1)
    tiling = {name: flow_tiling(name, w.shape[0] // parts, w.shape[1])
              for name, (w, parts) in weights.items()}
    nxt = None if next_lp is None else (lp.post_attention_layernorm_2,
                                        next_lp.input_layernorm, next_lp.qkv_proj)
    return mlp_stages(lp.o_proj, lp.input_layernorm_2, lp.post_attention_layernorm,
                      lp.gate_up_proj, lp.down_proj, next_qkv=nxt, tiling=tiling,
                      attention=attention)
