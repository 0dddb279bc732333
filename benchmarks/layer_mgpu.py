"""Whole decoder layers for one row (batch-1 decode) at the 1.4B shapes: the persistent Mosaic
GPU kernel with its attention stage (pallas_kernels/chain_mgpu.py, `attention=`: qkv ->
attention -> o -> gate/up -> down, 24 layers per call) against the engine's kernels for the
same layers (`engine`: the streaming GEMVs with their add_norm prologues, the Triton decode
kernel with RoPE and the K/V write, its XLA split merge) and the persistent kernel without
the attention stage (`noattn`: o reads q; the stage's own cost is the difference).

--loops passes over the layers per jitted call, each on its own cache planes (loop * L +
layer, as the engine's), the caches donated and fed back call after call; a row at
--length positions (the new token's included) with its pages shuffled. Reported: us per
layer application (wall, median of --repeats calls), TB/s over the weights' bytes, the
in-run copy bandwidth, and each arm's relative error against XLA's reference of the same
layers (chain_attention.reference_layers; the noattn arm against none).

    python3 -m benchmarks.layer_mgpu --out benchmarks/results/layer_mgpu_h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.chain_mgpu import make_norms, make_weights
from benchmarks.record import save_record
from benchmarks.timing import copy_bandwidth
from ouro_jax.projection_tuning import STREAM_TUNING
from pallas_kernels.chain_attention import ChainAttention, reference_layers
from pallas_kernels.chain_mgpu import Q_ROWS, gemv_chain_mgpu, tile_weights

KVH, HD, PAGE = 16, 128, 16


def make_cache(planes, length, seed=5):
    """Caches [planes, pages, 16, 16, 128] and the row's attention inputs at `length`."""
    from ouro_jax.model import rope_cos_sin
    n = -(-length // PAGE)
    table = (1 + np.random.default_rng(seed).permutation(n)).astype(np.int32)[None]
    ks = jax.random.split(jax.random.PRNGKey(seed), 2)
    shape = (planes, n + 1, PAGE, KVH, HD)
    kc, vc = (jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in ks)
    pos = length - 1
    cos, sin = rope_cos_sin(jnp.array([pos]), HD, 10000.0, jnp.bfloat16)
    rest = (jnp.asarray(table), jnp.int32(length), jnp.int32(table[0, pos // PAGE]),
            jnp.int32(pos % PAGE), cos, sin)
    return kc, vc, rest


def engine_layers(x, ws, norms, kc, vc, rest, loop, eps=1e-6):
    """The engine's one-row kernels for L layers of loop `loop`: returns (residual, last
    down output, k cache, v cache)."""
    from pallas_kernels.decode import paged_decode_attention_qkv
    from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
    bt, length, page, slot, cos, sin = rest
    d = jnp.zeros_like(x)
    n_layers = ws[0].shape[0]
    for l in range(n_layers):
        y, x = gemv_stream_normed(x, norms[1][l], ws[0][l], eps=eps, branch=d,
                                  branch_w=norms[0][l], **STREAM_TUNING["qkv"])
        a, kc, vc = paged_decode_attention_qkv(
            y.reshape(1, 3 * KVH, HD), kc, vc, (np.int32(loop), np.int32(l)), bt,
            jnp.reshape(length, (1,)), jnp.reshape(page, (1,)), jnp.reshape(slot, (1,)),
            rope=(cos, sin), trash_page=0, entry_stride=n_layers)
        o = gemv_stream(a.reshape(1, Q_ROWS), ws[1][l], **STREAM_TUNING["o"])
        y, x = gemv_stream_normed(x, norms[3][l], ws[2][l], eps=eps, branch=o,
                                  branch_w=norms[2][l], gated=True, **STREAM_TUNING["gate_up"])
        d = gemv_stream(y, ws[3][l], **STREAM_TUNING["down"])
    return x, d, kc, vc


def arm_fn(name, tiling, norms, loops, rest):
    """jit(f)(x, weights, kc, vc) -> (last residual, kc, vc), caches donated."""
    def f(x, w, kc, vc):
        for loop in range(loops):
            if name == "engine":
                x, _, kc, vc = engine_layers(x, w, norms, kc, vc, rest, loop)
            elif name == "noattn":
                x = gemv_chain_mgpu(x, w, norms=norms, **tiling)[5]
            else:
                att = ChainAttention(kc, vc, *rest[:3], rest[3], np.int32(loop), *rest[4:],
                                     **tiling.get("attn", {}))
                outs = gemv_chain_mgpu(x, w, norms=norms, attention=att,
                                       **{k: v for k, v in tiling.items() if k != "attn"})
                x, kc, vc = outs[5], outs[7], outs[8]
        return x, kc, vc
    return jax.jit(f, donate_argnums=(2, 3))


def parse_tilings(spec):
    """'16:256:12,16:256:12:b128s1' -> chain tilings (block_n, block_k, ring slots), the
    attention's K/V block and stages after 'b' / 's' (default 64, 2)."""
    out = []
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        try:
            bn, bk, ring = map(int, parts[:3])
            attn = {}
            if len(parts) > 3:
                b, s = parts[3].lstrip("b").split("s")
                attn = dict(block=int(b), stages=int(s))
        except ValueError:
            raise SystemExit(f"--tilings: {item!r} is not BN:BK:RING[:bBLOCKsSTAGES]") from None
        out.append(dict(block_n=bn, block_k=bk, stages=ring, attn=attn))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--length", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tilings", default="16:256:12,16:256:14,16:256:12:b128s1")
    ap.add_argument("--arms", default="engine,persistent,noattn")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    tilings = parse_tilings(args.tilings)
    ws = make_weights(args.layers)
    norms = make_norms(args.layers)
    mb = sum(w.size * 2 for w in ws) / args.layers / 1e6
    units = args.layers * args.loops
    copy = copy_bandwidth() / 1e12
    x0 = jax.random.normal(jax.random.PRNGKey(7), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    planes = args.layers * args.loops
    kc, vc, rest = make_cache(planes, args.length)
    ref_x = x0
    for loop in range(args.loops):  # XLA's reference of the same layers, loop after loop
        att = ChainAttention(kc, vc, *rest[:3], rest[3], loop, *rest[4:], trash_page=0)
        _, _, ref_x, _, kc, vc = reference_layers(ref_x, ws, norms, None, att)  # op by op
    ref = np.asarray(ref_x, np.float32)
    del kc, vc
    print(json.dumps(dict(device=jax.devices()[0].device_kind, mb_per_layer=round(mb, 2),
                          copy_tb_s=round(copy, 3), length=args.length)), flush=True)
    rows = []
    runs = [("engine", {})] if "engine" in args.arms else []
    for t in tilings:
        runs += [(a, t) for a in ("persistent", "noattn") if a in args.arms.split(",")]
    for name, tiling in runs:
        kc, vc, _ = make_cache(planes, args.length)
        w = ws if name == "engine" else tile_weights(ws, tiling["block_n"], tiling["block_k"])
        tiling = dict(tiling, attn=dict(tiling.get("attn", {}), trash_page=0))
        if name == "noattn":
            tiling.pop("attn")
        row = dict(arm=name, tiling=tiling)
        try:
            f = arm_fn(name, tiling, norms, args.loops, rest)
            t0 = time.perf_counter()
            out, kc, vc = jax.block_until_ready(f(x0, w, kc, vc))
            first = time.perf_counter() - t0
            got = np.asarray(out, np.float32)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                _, kc, vc = jax.block_until_ready(f(x0, w, kc, vc))
                times.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - report the arm and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        else:
            us = statistics.median(times) * 1e6 / units
            row.update(us_per_layer=round(us, 3), us_min=round(min(times) * 1e6 / units, 3),
                       tb_s=round(mb / us, 3), of_copy=round(mb / us / copy, 4),
                       first_call_s=round(first, 2),
                       rel_err_vs_xla=None if name == "noattn" else float(
                           np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean())))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del kc, vc
    save_record("benchmarks.layer_mgpu", argv, args.out, layers=args.layers, loops=args.loops,
                length=args.length, mb_per_layer=mb, copy_tb_s=copy, rows=rows)


if __name__ == "__main__":
    main()
