"""benchmarks.decode's command line: its parser, and the checks that refuse a run whose
switches would change nothing under their names (each says which switch needs what)."""

from __future__ import annotations

import argparse
import os

from benchmarks.decode_checks import check_values
from benchmarks.tuning import (DECODE_TUNING_KEYS, RAGGED_TUNING_KEYS, add_stream_args,
                               check_graph_pdl, parse_tuning)

PROJECTIONS_HELP = ("'auto' (default: 'gemv+norms+stream' on a GPU, else 'xla'), 'xla' "
                    "(einsum GEMMs), 'gemv' "
                    "(one-row calls through the Pallas GEMV), 'gemv@N' (up to N rows; slower beyond "
                    "one), 'gemv[@N]:qkv,o,gate_up,down', '+gemm[@N][:names]' (2..N-row calls "
                    "through the skinny Pallas GEMM), '+norms' (RMSNorms and residual adds in "
                    "the GEMV prologues), '+pfN' (the GEMV loads N K-chunks ahead, 0..4), '+stream' "
                    "(the streaming GEMV kernel), '+mgpu[:names]' (the Mosaic GPU GEMV for "
                    "those projections' one-row calls; jax >= 0.11, slower so far), '+flow' / "
                    "'+flow4' / '+flow5' (with norms and stream: o -> gate/up -> down [-> next "
                    "qkv [-> its attention]] of a one-row layer as one gemv_flow kernel; "
                    "experimental), '+graph' (with gemv+norms+stream: each one-row loop's "
                    "layers as one CUDA graph of our own with PDL edges; a GPU and the triton "
                    "package; experimental)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default in its help where it has
    one worth showing (not None, False or '')."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, "", argparse.SUPPRESS) and action.option_strings \
                and "%(default)" not in text and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser(doc: str) -> argparse.ArgumentParser:
    """benchmarks.decode's parser (doc: its help text's description)."""
    from ouro_jax.config import PRESETS
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=doc,
                                formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF Ouro checkpoint folder (default: random weights of "
                     "the --synthetic preset, drawn on the device)")
    src.add_argument("--synthetic", default="1.4b", choices=sorted(PRESETS),
                     help="model shape for random weights on the device")
    p.add_argument("--branch-scale", type=float, default=None,
                   help="synthetic only: post-branch norm scale, which sets the draft's "
                        "acceptance (default 0.003: the reference engine's recipe, ~80%% "
                        "greedy at k=4 d=2)")
    p.add_argument("--norm-jitter", type=float, default=None,
                   help="synthetic only: spread of the norm weights around 1 (default 0: HF's "
                        "init)")
    p.add_argument("--seed", type=int, default=None,
                   help="synthetic only: the random weights' seed (default 0)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="weights, activations and KV cache")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"],
                   help="attention kernels (auto: pallas on a GPU, else xla)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    p.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up GEMMs")
    p.add_argument("--projections", default="auto", help=PROJECTIONS_HELP)
    p.add_argument("--unroll-loops", action="store_true",
                   help="unroll the T loops in the program instead of a fori_loop")
    p.add_argument("--kv-write", default="fused", choices=["fused", "xla"],
                   help="decode's RoPE and K/V write: inside the Pallas decode kernel "
                        "(fused, default) or as XLA kernels (xla: the pre-session-6 path)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine's batch-invariant kernels (ouro_jax.invariant: greedy "
                        "speculative output bit-identical to native; slower); needs "
                        "--attention pallas or auto and --projections auto, and takes no "
                        "kernel tuning overrides but --invariant-tiling and --ragged-kernel's "
                        "block_t, num_warps, num_stages, direct; --kv-write xla moves its RoPE and "
                        "K/V write from a Pallas kernel to XLA")
    p.add_argument("--persistent-layers", action="store_true",
                   help="batch-1 decode loops as one persistent Mosaic GPU kernel each "
                        "(ouro_jax.persistent; jax >= 0.11, bf16, --attention pallas)")
    p.add_argument("--persistent-tiling", default="", metavar="K=V,...",
                   help="with --persistent-layers: the kernel's tiling for this run, e.g. "
                        "stages=14,uniform=1,smem_a=1 (keys: block_n, block_k, stages, "
                        "uniform, smem_a)")
    p.add_argument("--batch", default="1,8,32,64", help="batch sizes (requests per call)")
    p.add_argument("--k", default="0,2,4",
                   help="draft tokens per speculative round; 0 = native decode")
    p.add_argument("--draft-loops", type=int, default=2,
                   help="loops the speculative draft runs (1 <= d < the model's loops)")
    p.add_argument("--pipelined", action="store_true",
                   help="speculative runs (k must be 1, --draft-loops dividing the model's "
                        "loops) as pipelined self-speculation: the loops in stages of "
                        "--draft-loops, each pass running every stage on its own position "
                        "(ouro_jax.pipelined)")
    p.add_argument("--temperature", default="0,0.8", help="sampling temperatures; 0 = greedy")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens generated per request (ignore_eos); the first is prefill's")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls per configuration (compiles happen there; with 0 they "
                        "fall in the timed runs and are recorded as timed_compile_s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per configuration: median and spread are reported")
    p.add_argument("--sweep-branch-scale", default=None, metavar="S,...",
                   help="synthetic only: try these scales at batch 8, k=4 greedy and keep the "
                        "one whose acceptance is closest to --target-acceptance")
    p.add_argument("--target-acceptance", type=float, default=0.8,
                   help="with --sweep-branch-scale: the acceptance to aim for")
    p.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/ouro_jax/xla"),
                   help="persistent XLA compilation cache ('' disables); compile time is "
                        "reported apart either way")
    p.add_argument("--decode-kernel", default="", metavar="K=V,...",
                   help="override the Pallas decode kernel's tuning defaults for this run, "
                        "e.g. block_t=32,num_warps=2 (keys: %s)" % ",".join(DECODE_TUNING_KEYS))
    p.add_argument("--ragged-kernel", default="", metavar="K=V,...",
                   help="the same for the ragged kernel (verification, prefill, and decode "
                        "from ouro_jax.attention.RAGGED_FROM sequences up, where num_splits "
                        "and block_q are fixed) (keys: %s; with --batch-invariant only "
                        "block_t, num_warps, num_stages, direct)"
                        % ",".join(RAGGED_TUNING_KEYS))
    p.add_argument("--stream-tiling", default="", metavar="NAME=VARIANT,...",
                   help="override the streaming GEMV's tiling per projection for this run, e.g. "
                        "qkv=st1_k512_p1_w4 (VARIANT: a benchmarks.gemv STREAM_VARIANTS key)")
    p.add_argument("--mgpu-tiling", default="", metavar="NAME=bnN_bkN_ksN_stN[_ov],...",
                   help="override the Mosaic GPU GEMV's tiling (projections '+mgpu') per "
                        "projection for this run, e.g. down=bn64_bk64_ks8_st4 (block_n, "
                        "block_k, k_splits, stages; _ov: prologue overlapped with the first "
                        "weight tiles)")
    p.add_argument("--invariant-tiling", default="", metavar="NAME=VARIANT,...",
                   help="with --batch-invariant: the mode's GEMM tiling per weight (qkv, o, "
                        "gate_up, down, head) for this run, e.g. o=mm16_n16_k128_w4_s4_x4 "
                        "(VARIANT: a benchmarks.gemv GEMM_VARIANTS key; any one tiling per "
                        "weight keeps the mode's guarantee)")
    p.add_argument("--pdl", default="", metavar="NAME,...",
                   help="streaming projections whose GEMV lets the next kernel launch early "
                        "(programmatic dependent launch), e.g. qkv,o,gate_up; the decode "
                        "kernel's is --decode-kernel last_combine=1,pdl=1")
    p.add_argument("--pdl-at", default="start", choices=["start", "end"],
                   help="where --pdl's GEMVs trigger: at their start, or once their last "
                        "weight block has arrived")
    add_stream_args(p)
    p.add_argument("--out", help="JSON result path (each finished row also goes to OUT.partial "
                   "as it comes, so that a time-out keeps it)")
    return p


def check_run(args) -> dict:
    """Every check of a parsed command line (SystemExit naming the switch on a bad one),
    before any device work; leaves --batch, --k and --temperature parsed on args (batches,
    ks, temps); returns the --persistent-tiling overrides."""
    check_values(args)
    check_invariant_run(args)
    check_pdl_run(args)
    check_fuse_o_run(args)
    check_flow_o_run(args)
    check_graph_pdl(args)
    check_mgpu_run(args)
    check_o_merge_run(args)
    persistent_tiling = parse_persistent_tiling(args)
    if args.mgpu_tiling and "mgpu" not in args.projections:
        raise SystemExit("--mgpu-tiling sets the Mosaic GPU GEMV's tiling: give --projections "
                         "with an 'mgpu' part (e.g. gemv+norms+stream+mgpu:down), or leave it "
                         "out")
    return persistent_tiling


# The ragged kernel's settings the batch-invariant mode fixes itself; its block_t, num_warps
# and num_stages come from --ragged-kernel (pallas_kernels.ragged.TUNING) like any run's, and
# any fixed values keep the mode's guarantee.
INVARIANT_FIXED_RAGGED = ("num_splits", "block_q")


def check_invariant_run(args) -> None:
    """--batch-invariant picks its own kernels and tunings: other kernel switches would not
    be taken; --ragged-kernel may tune what the mode leaves open."""
    if not args.batch_invariant:
        if args.invariant_tiling.strip():
            raise SystemExit("--invariant-tiling tiles the batch-invariant mode's GEMM: add "
                             "--batch-invariant, or leave it out")
        return
    fixed = sorted(set(parse_tuning(args.ragged_kernel, RAGGED_TUNING_KEYS))
                   & set(INVARIANT_FIXED_RAGGED))
    if fixed:
        raise SystemExit(f"--batch-invariant fixes the ragged kernel's {', '.join(fixed)} "
                         f"(ouro_jax.invariant.ragged_tuning); --ragged-kernel may set only "
                         f"block_t, num_warps, num_stages, direct with it")
    given = [flag for flag, on in (
        ("--attention xla", args.attention == "xla"),
        ("--projections", args.projections != "auto"), ("--no-fuse", args.no_fuse),
        ("--persistent-layers", args.persistent_layers), ("--pdl", args.pdl),
        ("--decode-kernel", args.decode_kernel.strip()),
        ("--stream-tiling", args.stream_tiling.strip()), ("--mgpu-tiling", args.mgpu_tiling),
        ("--l2-prefetch", args.l2_prefetch), ("--l2-next", args.l2_next),
        ("--stream-set", args.stream_set)) if on]
    if given:
        raise SystemExit(f"--batch-invariant picks its own kernels; drop {', '.join(given)}")


def check_pdl_run(args) -> None:
    """--pdl and --decode-kernel pdl=1 make kernels let the next one launch early, which is safe
    only where that next kernel is a Pallas kernel that waits (pallas_kernels._common.PDL):
    the engine's GPU defaults (Pallas attention with the fused K/V write, the streaming GEMVs
    with the norm prologues), and for the decode kernel one row."""
    if not args.pdl and "pdl=1" not in args.decode_kernel.replace(" ", ""):
        return
    if (args.attention != "pallas" or args.kv_write != "fused" or args.projections != "auto"
            or args.no_fuse):
        raise SystemExit("--pdl / --decode-kernel pdl=1 need --attention pallas, --kv-write "
                         "fused, --projections auto and fused projections: with other paths "
                         "an XLA kernel can follow the triggering one")
    if "pdl=1" in args.decode_kernel.replace(" ", "") and args.batch.strip() != "1":
        raise SystemExit("--decode-kernel pdl=1 needs --batch 1: with more rows the o "
                         "projection after the decode kernel is an XLA GEMM")


def _asks(args, switch: str) -> bool:
    return switch in args.decode_kernel.replace(" ", "")


def _needs_fused_write(args, switch: str, why: str) -> None:
    """The decode kernel switches below change the fused-write decode kernel (Pallas
    attention, fused K/V write, fused qkv): elsewhere they would measure the default."""
    if args.attention != "pallas" or args.kv_write != "fused" or args.no_fuse:
        raise SystemExit(f"--decode-kernel {switch} needs --attention pallas, --kv-write fused "
                         f"and fused projections ({why})")


def _needs_batch_1(args, switch: str) -> None:
    if "1" not in [b.strip() for b in args.batch.split(",")]:
        raise SystemExit(f"--decode-kernel {switch} changes one-row decode only: give --batch 1 "
                         f"(other batch sizes run the default kernels)")


def check_fuse_o_run(args) -> None:
    """--decode-kernel fuse_o=1 changes only one-row decode steps on the Pallas attention with
    the fused K/V write and the fused qkv weight; anywhere else it would silently measure the
    default, so say so instead."""
    if not _asks(args, "fuse_o=1"):
        return
    _needs_fused_write(args, "fuse_o=1", "it replaces the fused-write decode kernel")
    _needs_batch_1(args, "fuse_o=1")
    from ouro_jax.attention import FUSE_O_MAX_KEYS
    if (not _asks(args, "o_split=1")
            and args.prompt_len + args.new_tokens + 16 > FUSE_O_MAX_KEYS):
        raise SystemExit(f"--decode-kernel fuse_o=1 runs unsplit only up to {FUSE_O_MAX_KEYS} "
                         f"keys (ouro_jax.attention.FUSE_O_MAX_KEYS); give o_split=1 or a "
                         f"shorter --prompt-len / --new-tokens")


def check_flow_o_run(args) -> None:
    """--decode-kernel flow_o=1 changes only one-row decode steps on the Pallas attention with
    the fused K/V write and the fused qkv weight (as fuse_o=1): say so rather than measure
    the default under its name."""
    if not _asks(args, "flow_o=1"):
        return
    _needs_fused_write(args, "flow_o=1", "its first stage is the fused-write decode kernel's "
                       "body")
    _needs_batch_1(args, "flow_o=1")
    from ouro_jax.projection_spec import FLOW_PARTS
    if set(args.projections.split("+")) & set(FLOW_PARTS):
        raise SystemExit("--decode-kernel flow_o=1 runs o with the attention: the '+flow' "
                         "projections (which start with o) would never run; use one")


def check_o_merge_run(args) -> None:
    """--decode-kernel o_merge=1 changes only one-row decode steps whose o projection is the
    streaming GEMV after the fused-write decode kernel; with '+graph', '+flow' parts or
    --persistent-layers those steps run other kernels, and it would measure them under its
    name."""
    if not _asks(args, "o_merge=1"):
        return
    _needs_fused_write(args, "o_merge=1", "it changes the fused-write decode kernel")
    _needs_batch_1(args, "o_merge=1")
    from ouro_jax.projection_spec import FLOW_PARTS
    parts = set(args.projections.split("+"))
    streams = args.projections == "auto" or "stream" in parts
    if not streams or parts & (set(FLOW_PARTS) | {"graph"}) or args.persistent_layers:
        raise SystemExit("--decode-kernel o_merge=1 merges in the streaming o GEMV: it needs "
                         "--projections auto (or one with 'stream') without '+graph' or "
                         "'+flow' parts, and no --persistent-layers")


def check_ragged_decode_run(args, decode: dict) -> None:
    """Decode of ouro_jax.attention.RAGGED_FROM sequences or more (or --decode-kernel
    ragged_from=N) runs the ragged kernel, not the decode kernel: other --decode-kernel keys
    would change nothing at those batch sizes and the record would name them; say so
    (ragged_from=0 keeps the decode kernel everywhere). `decode`: the parsed --decode-kernel
    (benchmarks.tuning.apply_kernel_tuning's "decode"), so the keys' own errors come first."""
    from ouro_jax.attention import RAGGED_FROM
    items = dict(decode)
    items.pop("skip_done", None)  # (the engine's, whichever kernel attends)
    start = items.pop("ragged_from", RAGGED_FROM)
    big = [b for b in args.batches if start and b >= start]
    if items and big and not args.batch_invariant:
        raise SystemExit(f"--decode-kernel {','.join(sorted(items))} tunes the decode kernel, "
                         f"which decode of {start} or more sequences does not run (batch "
                         f"{big}: the ragged kernel, ouro_jax.attention.RAGGED_FROM); add "
                         f"ragged_from=0 to measure the decode kernel there, or drop those "
                         f"batch sizes")


def check_mgpu_run(args) -> None:
    """--decode-kernel mgpu=1 replaces the fused-write decode kernel (Pallas attention, fused
    K/V write, fused qkv); anywhere else it would silently measure the default."""
    if not _asks(args, "mgpu=1"):
        return
    _needs_fused_write(args, "mgpu=1", "it replaces the fused-write decode kernel")
    if "flow5" in args.projections.split("+"):
        raise SystemExit("--decode-kernel mgpu=1 has no gemv_flow attention stage, which "
                         "'+flow5' projections run: drop one of them")


def parse_persistent_tiling(args) -> dict:
    """--persistent-tiling 'stages=14,uniform=1' -> {'stages': 14, 'uniform': True}; it
    needs --persistent-layers (else it would change nothing under its name)."""
    from ouro_jax.persistent import TILING
    out = {}
    for item in filter(None, (x.strip() for x in args.persistent_tiling.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in TILING or not value.isdigit():
            raise SystemExit(f"--persistent-tiling: {item!r} is not KEY=INT with KEY in "
                             f"{sorted(TILING)}")
        out[key] = bool(int(value)) if isinstance(TILING[key], bool) else int(value)
    if out and not args.persistent_layers:
        raise SystemExit("--persistent-tiling tiles the --persistent-layers kernel: give both")
    return out
