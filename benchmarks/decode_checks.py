"""benchmarks.decode's value checks: every list and number on its command line is read and
refused by its flag's name before the bandwidth probe, the model build or any timed run
(a bad value used to surface as a traceback after ~1 minute of set-up, or after earlier
configurations had already run). `check_values` leaves the parsed lists on `args`."""

from __future__ import annotations

import math
import os

# the reference engine's recipe for synthetic weights (docs/performance.md: ~80% greedy
# acceptance at k=4 d=2); the synthetic-only flags' defaults, filled in by check_values
SYNTHETIC_DEFAULTS = dict(branch_scale=0.003, norm_jitter=0.0, seed=0)


def _items(flag: str, text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise SystemExit(f"{flag} {text!r}: give a comma-separated list with no empty items")
    return items


def number_list(flag: str, text: str, cast, low, low_open: bool = False) -> list:
    """'1,8,32' -> [1, 8, 32] (cast int or float), each finite and >= low (> low with
    low_open), refused by the flag's name otherwise."""
    out = []
    for x in _items(flag, text):
        try:
            value = cast(x)
        except ValueError:
            raise SystemExit(f"{flag}: {x!r} is not {'an integer' if cast is int else 'a number'}") \
                from None
        if not math.isfinite(value) or value < low or (low_open and value == low):
            raise SystemExit(f"{flag}: {x} must be finite and {'>' if low_open else '>='} {low}")
        out.append(value)
    return out


def model_config(args):
    """The config of the model the run will build (a preset, or the folder's config.json),
    read without loading any weights."""
    from ouro_jax.config import PRESETS, OuroConfig
    if not args.model:
        return PRESETS[args.synthetic]
    if not os.path.isdir(args.model):
        raise SystemExit(f"--model {args.model!r}: no such folder")
    try:
        return OuroConfig.from_json(args.model)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model {args.model!r}: {e}") from None


def check_synthetic_only(args) -> None:
    """The synthetic-weight flags change nothing for a checkpoint (the run would record a
    branch scale the weights never had): refused with --model, else given their defaults."""
    given = [f"--{k.replace('_', '-')}" for k in SYNTHETIC_DEFAULTS if getattr(args, k) is not None]
    if args.sweep_branch_scale is not None:
        given.append("--sweep-branch-scale")
    if args.model and given:
        raise SystemExit(f"{', '.join(given)} set(s) the synthetic weights; --model "
                         f"{args.model!r} has its own: leave {'it' if len(given) == 1 else 'them'} "
                         f"out")
    for key, default in SYNTHETIC_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.sweep_branch_scale is not None:
        args.sweep_scales = number_list("--sweep-branch-scale", args.sweep_branch_scale,
                                        float, 0.0, low_open=True)
        if not 0.0 <= args.target_acceptance <= 1.0:
            raise SystemExit(f"--target-acceptance {args.target_acceptance} is outside [0, 1]")


def check_out(out) -> None:
    """--out must name a file whose folder exists or can be made (the run's rows go to
    OUT.partial as they finish, so a bad path would lose them)."""
    if not out:
        return
    if os.path.isdir(out):
        raise SystemExit(f"--out {out!r} is a folder: give a file path, e.g. {out}/decode.json")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise SystemExit(f"--out {out!r}: {parent!r} is a file, not a folder")


def check_values(args) -> None:
    """Parses --batch, --k and --temperature into args.batches, args.ks and args.temps and
    checks every number against the model the run will build."""
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig
    check_synthetic_only(args)
    args.batches = number_list("--batch", args.batch, int, 1)
    args.ks = number_list("--k", args.k, int, 0)
    args.temps = number_list("--temperature", args.temperature, float, 0.0)
    for flag, value, low in (("--repeats", args.repeats, 1), ("--page-size", args.page_size, 1),
                             ("--prompt-len", args.prompt_len, 1),
                             # (0 is for profilers that count launches from the first
                             # call, e.g. gpu_session31_call.sh's ncu step; a compile in a
                             # timed run is then recorded as timed_compile_s and said)
                             ("--warmup", args.warmup, 0),
                             # the first token is prefill's: decode timing needs a second
                             ("--new-tokens", args.new_tokens, 2)):
        if value < low:
            raise SystemExit(f"{flag} must be >= {low}, got {value}")
    cfg = model_config(args)
    limit = cfg.max_position_embeddings
    if args.prompt_len + args.new_tokens > limit:
        raise SystemExit(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} is "
                         f"over the model's {limit} positions (max_position_embeddings)")
    try:
        for k in args.ks:
            if k:
                SpeculativeConfig(k, args.draft_loops, pipelined=args.pipelined).validate(cfg)
        for t in args.temps:
            SamplingParams(max_tokens=args.new_tokens, temperature=t)
    except ValueError as e:
        raise SystemExit(f"{e} (--k / --draft-loops / --temperature)") from None
    if args.projections != "auto":  # (its own parse: the engine would refuse it after set-up)
        from ouro_jax.projection_spec import parse
        try:
            parse(args.projections)
        except ValueError as e:
            raise SystemExit(f"--projections: {e}") from None
    check_out(args.out)
