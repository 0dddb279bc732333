"""Command-line generation: `python -m ouro_jax.generate --prompt "..."`.

With no --model it runs the embedded demo model that ships with the package. Human output
streams text as each chunk arrives and ends with a stats line; --json prints one object per
request plus the stats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from ouro_jax.sampling import SamplingParams


_INT = re.compile(r"\s*[+-]?[0-9]+\s*")


def _int_list(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]; '' -> []. Every comma-separated item must be one integer:
    '1 2' or '1,,2' are errors, not 12 or [1, 2] (int() alone would take '1_0' as 10)."""
    if not text.strip():
        return []
    items = text.split(",")
    bad = [t for t in items if not _INT.fullmatch(t)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r} (not an integer: {bad[0]!r})")
    return [int(t) for t in items]


def _projections(text: str) -> str:
    """Checks a --projections spec at parse time (before any checkpoint is read)."""
    if text == "auto":
        return text
    from ouro_jax.projections import parse
    try:
        parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ouro_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF Ouro checkpoint folder (default: embedded demo model)")
    src = p.add_argument_group("prompts (any mix; at least one)")
    src.add_argument("--prompt", action="append", default=[],
                     help="text prompt (repeatable). Requests are numbered (their [i] and "
                          "seed + i) text prompts first, then --prompt-ids, then the file's "
                          "lines, whatever the order on the command line")
    src.add_argument("--prompts-file", help='JSONL: {"prompt": "..."} or {"prompt_ids": [...]}')
    src.add_argument("--prompt-ids", action="append", type=_int_list, default=[],
                     help="comma-separated token ids (repeatable)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=None, help="0 = off (default; needs "
                   "--temperature > 0)")
    s.add_argument("--top-p", type=float, default=None, help="default 1.0 (needs "
                   "--temperature > 0)")
    s.add_argument("--seed", type=int, default=None, help="request i uses seed + i (default 0; "
                   "needs --temperature > 0)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--stop-token-ids", type=_int_list, default=[])
    s.add_argument("--logprobs", action="store_true", help="report raw log-probs of chosen tokens")
    e = p.add_argument_group("exit (default: the reference's threshold rule, all loops run; "
                             "give at most one of these)")
    e.add_argument("--exit-at-step", type=int, default=None, help="use this loop's logits (0-based)")
    e.add_argument("--exit-threshold", type=float, default=None,
                   help="cumulative exit probability threshold (default: config's)")
    e.add_argument("--weighted-exit", action="store_true",
                   help="mix every loop's logits by the exit probabilities")
    sp = p.add_argument_group("speculative decoding (exact)")
    sp.add_argument("--speculative-k", type=int, default=0, help="draft tokens per round (0 = off)")
    sp.add_argument("--draft-loops", type=int, default=None,
                    help="loops the draft runs (default 2; needs --speculative-k)")
    sp.add_argument("--rounds-per-fetch", type=int, default=None,
                    help="rounds (pipelined: ticks) between host fetches (default 16; "
                         "needs --speculative-k)")
    sp.add_argument("--pipelined", action="store_true",
                    help="pipelined self-speculation (needs --speculative-k 1; --draft-loops "
                         "must divide the model's loops): the loops run in stages of "
                         "--draft-loops, each pass running every stage on its own position, "
                         "drafts entering the first (ouro_jax/pipelined.py)")
    r = p.add_argument_group("runtime")
    r.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="compute dtype (default fp32, exact against the fp32 reference; on a "
                        "GPU, bf16 reads half the bytes per token)")
    r.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"])
    r.add_argument("--projections", default="auto", type=_projections,
                   help="'auto' (default: 'gemv+norms+stream' on a GPU, else 'xla'), 'xla' "
                        "(einsum GEMMs), "
                        "'gemv' (one-row calls through the Pallas GEMV), 'gemv@N' (calls of up to "
                        "N rows; slower beyond one), 'gemv[@N]:qkv,o,gate_up,down' (a subset); "
                        "'+gemm[@N][:names]' adds the skinny Pallas GEMM for 2..N-row calls, "
                        "'+norms' the RMSNorms and residual adds in the GEMV prologues, '+pfN' "
                        "the GEMV's prefetch depth (K chunks loaded ahead, 0..4), '+stream' the "
                        "streaming GEMV kernel, '+mgpu[:names]' the Mosaic GPU GEMV for those "
                        "projections (jax >= 0.11), '+flow' / '+flow4' / '+flow5' (with norms "
                        "and stream, experimental: a one-row layer's o -> gate/up -> down [-> "
                        "the next qkv [-> its attention]] as one kernel, measured slower), "
                        "'+graph' (with gemv+norms+stream, experimental: each one-row loop's "
                        "layers as one CUDA graph of our own with PDL edges; a GPU and the "
                        "triton package); figures in docs/performance.md")
    r.add_argument("--persistent-layers", action="store_true",
                   help="batch-1 decode: each loop's layers as one persistent Mosaic GPU "
                        "kernel (jax >= 0.11, bf16, --attention pallas; experimental and slower: "
                        "113.7 against 205.0 tok/s on an H100, docs/performance.md)")
    r.add_argument("--batch-invariant", action="store_true",
                   help="kernels whose every row computes alike whatever shares the call "
                        "(ouro_jax.invariant): in bf16 too, a request's tokens then do not "
                        "depend on the batch, and greedy speculative output is bit-identical "
                        "to native greedy, at temperature 0 (tested on the CPU and an H100); "
                        "slower (the Pallas GEMM and ragged attention everywhere: on an H100 "
                        "0.78x native at batch 1, 0.93x at 8, session 40); needs --attention "
                        "pallas or auto and --projections auto")
    r.add_argument("--page-size", type=int, default=16)
    r.add_argument("--decode-chunk", type=int, default=32, help="decode steps per host fetch")
    r.add_argument("--kv-pool-tokens", type=int, default=None,
                   help="fixed KV pool size in tokens (default: sized to each batch)")
    r.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/ouro_jax/xla"),
                   help="persistent XLA compilation cache folder ('' disables): a second run "
                        "of the same shapes loads programs instead of compiling")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _load_prompts(args) -> list:
    prompts: list = list(args.prompt) + list(args.prompt_ids)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                lines = f.readlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {e}") from e
        for n, line in enumerate(lines, 1):
            if line.strip():
                prompts.append(_jsonl_prompt(line, f"{args.prompts_file}:{n}"))
    if not prompts:
        raise ValueError("no prompt given: use --prompt, --prompt-ids or --prompts-file")
    return prompts


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs):
    """json's object_pairs_hook: a key given twice is an error, not the last one winning."""
    keys = [k for k, _ in pairs]
    dup = [k for k in keys if keys.count(k) > 1]
    if dup:
        raise _RepeatedKey(f"key {dup[0]!r} given twice")
    return dict(pairs)


def _jsonl_prompt(line: str, where: str):
    """One --prompts-file line: {"prompt": text} or {"prompt_ids": [int, ...]}."""
    try:
        obj = json.loads(line, object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from e
    if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
        raise ValueError(f"{where}: needs an object with one of 'prompt' or 'prompt_ids'")
    extra = sorted(set(obj) - {"prompt", "prompt_ids"})
    if extra:  # e.g. per-line sampling settings, which the file format does not take
        raise ValueError(f"{where}: unknown key(s) {extra}: a line holds 'prompt' or "
                         f"'prompt_ids' only (sampling settings are flags)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {obj['prompt']!r}")
        return obj["prompt"]
    ids = obj["prompt_ids"]
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError(f"{where}: 'prompt_ids' must be a list of integers, got {ids!r}")
    return ids


def _check_flags(args, num_prompts: int) -> None:
    """Flags that would otherwise be ignored or fail later with a value the user never gave."""
    if not args.speculative_k:
        given = [f for f, v in (("--draft-loops", args.draft_loops),
                                ("--rounds-per-fetch", args.rounds_per_fetch),
                                ("--pipelined", args.pipelined or None)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)}: speculative settings, which need "
                             f"--speculative-k N")
    exits = [f for f, v in (("--exit-at-step", args.exit_at_step is not None),
                            ("--exit-threshold", args.exit_threshold is not None),
                            ("--weighted-exit", args.weighted_exit)) if v]
    if len(exits) > 1:
        raise ValueError(f"give at most one of {', '.join(exits)}")
    if not args.temperature:  # greedy: these would change nothing
        given = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                ("--seed", args.seed)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)}: sampling settings, which need "
                             f"--temperature > 0 (temperature 0 is greedy)")
    seed = args.seed or 0
    if seed >= 0 and seed + num_prompts - 1 >= 2**32:
        raise ValueError(f"--seed {seed}: prompt i uses seed + i, so seed + "
                         f"{num_prompts - 1} must be below 2**32")


class _Streamer:
    """Prints each request's new text as chunks arrive (decoding whole sequences so multi-byte
    characters split across chunks come out right)."""

    def __init__(self, llm, n, echo: str = ""):
        self.llm, self.ids, self.shown = llm, [[] for _ in range(n)], [""] * n
        self.echo = echo

    def __call__(self, new):
        if self.echo:  # the prompt, once generation has really started
            print(self.echo, end="", flush=True)
            self.echo = ""
        for i, toks in enumerate(new):
            if not toks:
                continue
            self.ids[i].extend(toks)
            text = self.llm.decode_text(self.ids[i])
            text = str(self.ids[i]) if text is None else text.rstrip("\ufffd")
            delta = text[len(self.shown[i]):] if text.startswith(self.shown[i]) else "\n" + text
            self.shown[i] = text
            if len(new) > 1:
                print(f"[{i}] {delta}", flush=True)
            else:
                print(delta, end="", flush=True)


def _compile_progress(name: str, seconds) -> None:
    """Stderr progress while a device program compiles (or loads from the persistent cache),
    which happens before any token is streamed."""
    if seconds is None:
        print(f"(compiling {name} ...", end="", file=sys.stderr, flush=True)
    elif seconds != seconds:  # NaN: the compile raised; its error follows on a new line
        print(" failed)", file=sys.stderr, flush=True)
    else:
        print(f" {seconds:.2f}s)", file=sys.stderr, flush=True)


def _dtype_hint(folder) -> str:
    """A note when the dtype was left at its default (fp32) for a bf16 checkpoint on a GPU:
    decode reads every weight per token, so fp32 runs at about half the speed."""
    import jax

    if folder is None or jax.devices()[0].platform != "gpu":
        return ""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            stored = json.load(f).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return ""
    if stored != "bfloat16":
        return ""
    return ("(note: this bf16 checkpoint runs in fp32, the default; --dtype bf16 reads half "
            "the weight bytes per token, so decode runs faster: see README, Performance)")


def enable_compile_cache(folder: str) -> None:
    import jax

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot use --compile-cache {folder}: {e}") from e
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ouro_jax.api import Ouro
    from ouro_jax.speculative import SpeculativeConfig

    try:
        if args.compile_cache:
            enable_compile_cache(args.compile_cache)
        prompts = _load_prompts(args)
        _check_flags(args, len(prompts))
        # (the sampling flags' defaults; None told _check_flags they were not given)
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                 top_k=args.top_k or 0,
                                 top_p=1.0 if args.top_p is None else args.top_p,
                                 seed=(args.seed or 0) + i,
                                 ignore_eos=args.ignore_eos, stop_token_ids=tuple(args.stop_token_ids),
                                 logprobs=args.logprobs) for i in range(len(prompts))]
        spec = (SpeculativeConfig(args.speculative_k,
                                  2 if args.draft_loops is None else args.draft_loops,
                                  rounds_per_fetch=(16 if args.rounds_per_fetch is None
                                                    else args.rounds_per_fetch),
                                  pipelined=args.pipelined)
                if args.speculative_k else None)
        t0 = time.perf_counter()
        llm = Ouro.load(args.model, args.dtype or "fp32", page_size=args.page_size,
                        attention=args.attention,
                        projections=args.projections,
                        decode_chunk=args.decode_chunk, kv_pool_tokens=args.kv_pool_tokens,
                        persistent_layers=args.persistent_layers,
                        batch_invariant=args.batch_invariant)
        load_s = time.perf_counter() - t0
        hint = "" if args.dtype or args.json else _dtype_hint(args.model)
        if hint:
            print(hint, file=sys.stderr)
        if args.model is None and not args.json:
            print(f"(embedded demo model: {llm.cfg.num_params() / 1e6:.2f}M parameters; "
                  f"see ouro_jax/demo_model/README.md)", file=sys.stderr)
        echo = prompts[0] if len(prompts) == 1 and isinstance(prompts[0], str) else ""
        streamer = None if args.json else _Streamer(llm, len(prompts), echo)
        if not args.json:  # a first compile of the 1.4B programs takes tens of seconds
            llm.programs.on_compile = _compile_progress
        res = llm.generate(prompts, params, exit_at_step=args.exit_at_step,
                           exit_threshold=args.exit_threshold, weighted_exit=args.weighted_exit,
                           speculative=spec, on_chunk=streamer)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for out in res.outputs:
            print(json.dumps(out.to_json()))
        print(json.dumps({"stats": dict(res.stats.to_json(), load_s=load_s,
                                        load_phases=llm.load_phases)}))
    else:
        print()
        for out in res.outputs:
            if len(prompts) > 1:
                print(f"[{out.index}] finish={out.finish_reason} tokens={len(out.token_ids)}")
            if out.logprobs is not None:
                pairs = " ".join(f"{t}:{lp:.3f}" for t, lp in zip(out.token_ids, out.logprobs))
                print(f"[{out.index}] logprobs (token:logprob) {pairs}")
        print(f"stats: {res.stats.line()} | load {load_s:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
