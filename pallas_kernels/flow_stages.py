"""gemv_flow's stages: a GEMV Stage, the engine's one-row tilings, and the sandwich layer's
chains (o -> gate/up -> down [-> the next layer's qkv [-> its attention]]) as stage lists.
The kernel that runs them: pallas_kernels/gemv_flow.py."""

from __future__ import annotations

from typing import NamedTuple

import jax


class Stage(NamedTuple):
    """One GEMV of the chain: weight w [N, K] (gated: [gate; up], [2I, K]); add_norm: the
    stage's input is rms_norm(x', norm_w) with x' = resid + rms_norm(previous output,
    branch_w). tiling: gemv_stream's block_n / block_k / per_program for this stage."""
    w: jax.Array
    gated: bool = False
    branch_w: jax.Array | None = None
    norm_w: jax.Array | None = None
    tiling: dict | None = None
    name: str = ""

    @property
    def add_norm(self) -> bool:
        return self.norm_w is not None


# The engine's one-row tilings (projections.STREAM_TUNING without num_warps; the flow
# kernel runs at projections.FLOW_NUM_WARPS). Since session 31 qkv and gate/up read the
# whole K = 2048 row as one block; sessions 21-24 measured the flow at block_k 512 for all
# four (mlp_stages' `tiling` gives it back).
ENGINE_TILING = dict(o=dict(block_n=2, block_k=512, per_program=2),
                     gate_up=dict(block_n=2, block_k=2048, per_program=8),
                     down=dict(block_n=1, block_k=512, per_program=4),
                     qkv=dict(block_n=4, block_k=2048, per_program=4))


def mlp_stages(w_o, w_post_attn, w_pre_mlp, w_gate_up, w_down, *, next_qkv=None,
               tiling=None, attention=None) -> list:
    """The sandwich layer's o -> gate/up -> down as Stages (model.decoder_layer: h = x +
    rms_norm(o, input_layernorm_2), m = silu(gate) * up of rms_norm(h, post_attention_
    layernorm), then down), and with next_qkv = (post_attention_layernorm_2, the next layer's
    input_layernorm, its qkv weight) the next layer's qkv of rms_norm(h + rms_norm(down,
    ...)). tiling: per name, gemv_stream's block_n / block_k / per_program (default
    ENGINE_TILING, whose block_k fits K=2048). attention (with next_qkv): a
    flow_attention.AttnStage, the next layer's decode attention on that qkv, as a last stage
    (the whole layer in one kernel: its output is the next layer's o input)."""
    t = {n: dict(v) for n, v in ENGINE_TILING.items()}
    for name, v in (tiling or {}).items():
        if name not in t:
            raise ValueError(f"mlp_stages tiling names one of {sorted(t)}, got {name!r}")
        t[name].update(v)
    stages = [Stage(w_o, tiling=t["o"], name="o"),
              Stage(w_gate_up, gated=True, branch_w=w_post_attn, norm_w=w_pre_mlp,
                    tiling=t["gate_up"], name="gate_up"),
              Stage(w_down, tiling=t["down"], name="down")]
    if next_qkv is not None:
        w_post2, w_in, w_qkv = next_qkv
        stages.append(Stage(w_qkv, branch_w=w_post2, norm_w=w_in, tiling=t["qkv"],
                            name="qkv"))
    if attention is not None:
        if next_qkv is None:
            raise ValueError("mlp_stages: the attention stage reads the next layer's qkv "
                             "(pass next_qkv)")
        stages.append(attention)
    return stages
