"""A loop of decoder layers with the norms folded into the projections (few-row decode).

Same math as `model.decoder_layer`, regrouped so each projection absorbs the elementwise work
around it (pallas_kernels/matvec.py): a layer's output `h + rms_norm(down, w)` is left
pending and added, together with the next layer's input norm, inside the next qkv
projection; the attention residual and the MLP's input norm ride on the gate/up projection,
whose epilogue applies SiLU(gate) * up. Per layer that is qkv, attention, o_proj, gate/up,
down: five launches where XLA runs about a dozen kernels around the same GEMMs.

Used by the engine with the "+fusedmv" backend option, only where every projection fits the
kernel (rows <= 16, dimensions divisible by 16); elsewhere `model.run_loop` runs as usual.
"""

from __future__ import annotations

import jax

from ouro_jax.model import attention_from_qkv, linear, rms_norm


def can_fuse(params, cfg, rows: int) -> bool:
    from pallas_kernels.matvec import supported

    layers = params.layers
    if not isinstance(layers, (tuple, list)):
        return False
    if any(lp.qkv_proj is None or lp.gate_up_proj is None for lp in layers):
        return False
    d = cfg.hidden_size
    return (supported(rows, d, layers[0].qkv_proj.shape[0])
            and supported(rows, d, cfg.intermediate_size))


def run_loop_fused(params, h, cos, sin, cfg, attend, state, loop):
    """model.run_loop for unstacked, fused-projection weights (see can_fuse)."""
    from pallas_kernels.matvec import fused_norm_matvec

    eps = cfg.rms_norm_eps
    interpret = jax.default_backend() != "gpu"
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    pending = None  # (branch, weight): the previous layer's output is x + rms_norm(branch)*weight
    for layer, lp in enumerate(params.layers):
        res = dict(d=pending[0], w_res=pending[1]) if pending else {}
        x, qkv = fused_norm_matvec(x, lp.input_layernorm, lp.qkv_proj, eps=eps,
                                   interpret=interpret, **res)
        o, state = attention_from_qkv(lp, qkv.reshape(*shape[:-1], -1), cos, sin, cfg, attend,
                                      state, loop, layer)
        x, act = fused_norm_matvec(x, lp.post_attention_layernorm, lp.gate_up_proj, eps=eps,
                                   d=o.reshape(x.shape), w_res=lp.input_layernorm_2, gated=True,
                                   interpret=interpret)
        pending = (linear(act, lp.down_proj), lp.post_attention_layernorm_2)
    x = x + rms_norm(pending[0], pending[1], eps)
    return rms_norm(x.reshape(shape), params.norm, eps), state
