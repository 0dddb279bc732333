"""ouro_jax.trace_once: each distinct kernel call of a program traced and lowered once, and the
program unchanged by it."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import trace_once


def _counting():
    traces = []

    def kernel(x, w, *, scale, shape=(2,)):
        traces.append(scale)
        return x * scale + w.sum() + len(shape)
    return kernel, traces


def test_equal_calls_share_one_trace_and_give_the_same_values():
    kernel, traces = _counting()
    x, w = jnp.arange(4.0), jnp.ones((3,))

    def program(x, w):
        a = trace_once.call(kernel, x, w, scale=2.0)
        b = trace_once.call(kernel, a, w, scale=2.0)  # same statics, same shapes: shared
        c = trace_once.call(kernel, b, w, scale=3.0)  # another static: its own trace
        d = trace_once.call(kernel, c, w, scale=3.0, shape=(1, 2, 3))  # another structure
        return d

    with trace_once.scope():
        shared = jax.jit(program)(x, w)
    assert traces == [2.0, 3.0, 3.0]
    traces.clear()
    plain = jax.jit(lambda *a: program(*a))(x, w)  # no scope: a plain call each time
    assert traces == [2.0, 2.0, 3.0, 3.0]
    np.testing.assert_array_equal(shared, plain)
    np.testing.assert_array_equal(plain, program(x, w))  # eager, no jit at all


def test_a_new_scope_traces_again():
    """Kernels read module-level tuning at trace time; a later program must see its change."""
    setting = {"scale": 1.0}
    traces = []

    def kernel(x):
        traces.append(setting["scale"])
        return x * setting["scale"]

    outs = []
    for scale in (1.0, 5.0):
        setting["scale"] = scale
        with trace_once.scope():
            outs.append(jax.jit(lambda x: trace_once.call(kernel, x))(jnp.ones(2)))
    assert traces == [1.0, 5.0]
    np.testing.assert_array_equal(outs[1], [5.0, 5.0])


def test_arrays_are_arguments_and_other_leaves_are_kept_as_given():
    seen = []

    def kernel(x, entry, *, table, name, bias):
        seen.append((type(entry[0]).__name__, isinstance(entry[1], jax.core.Tracer), table, name,
                     isinstance(bias, jax.core.Tracer)))
        return x + entry[1] + bias

    with trace_once.scope():
        f = jax.jit(lambda x: [trace_once.call(kernel, x, (7, np.asarray(layer, np.int32)),
                                               table={"a": (1, 2)}, name="k", bias=x * layer)
                               for layer in range(3)])
        out = f(jnp.ones(2))
    assert seen == [("int", True, {"a": (1, 2)}, "k", True)]  # one trace for the three layers
    np.testing.assert_array_equal(np.stack(out), [[1, 1], [3, 3], [5, 5]])


def test_settings_equal_in_value_but_not_in_kind_get_their_own_traces():
    """True == 1 == 1.0, 2.0 == np.float32(2) and 0.0 == -0.0 as dict keys, but a kernel
    may act differently on each (dtype promotion, signs): each keeps its own trace."""
    seen = []

    def kernel(x, *, s):
        seen.append(s)
        return x * s + jnp.copysign(1.0, s)

    x = jnp.ones(2, jnp.bfloat16)
    settings = [1, True, 1.0, 2.0, np.float32(2), 0.0, -0.0]
    with trace_once.scope():
        outs = jax.jit(lambda x: [trace_once.call(kernel, x, s=s) for s in settings])(x)
    assert len(seen) == len(settings)
    assert [type(v) for v in seen] == [type(v) for v in settings]
    assert outs[3].dtype == jnp.bfloat16 and outs[4].dtype == jnp.float32
    np.testing.assert_array_equal(outs[5], [1, 1])
    np.testing.assert_array_equal(outs[6], [-1, -1])


def test_an_unhashable_setting_is_called_directly():
    kernel, traces = _counting()
    with trace_once.scope():
        jax.jit(lambda x: [trace_once.call(kernel, x, x, scale=s) for s in (1.0, 1.0)])(
            jnp.ones(2))
        assert traces == [1.0]
        traces.clear()
        # a set is a pytree leaf, and not hashable
        jax.jit(lambda x: [trace_once.call(kernel, x, x, scale=1.0, shape=[{1}]) for _ in "ab"])(
            jnp.ones(2))
    assert traces == [1.0, 1.0]


def test_disabled_scopes_share_nothing(monkeypatch):
    kernel, traces = _counting()
    monkeypatch.setattr(trace_once, "ENABLED", False)
    with trace_once.scope():
        assert not trace_once.active()
        jax.jit(lambda x: [trace_once.call(kernel, x, x, scale=1.0) for _ in "ab"])(jnp.ones(2))
    assert traces == [1.0, 1.0]


def test_scopes_nest_and_restore():
    assert not trace_once.active()
    with trace_once.scope():
        with trace_once.scope():
            assert trace_once.active()
        assert trace_once.active()
    assert not trace_once.active()


# ---------------------------------------------------------------- the engine's programs
def _gpu_program_texts(k: int) -> dict:
    """The tiny model's decode (k=0) or speculative (k) program, lowered for the GPU on this
    machine, with and without sharing."""
    from unittest import mock
    from benchmarks import lower_time
    from pallas_kernels.offline_compile import sm90_device_info
    args = lower_time.parse_args(["--preset", "tiny-gqa", "--platform", "cuda", "--k", str(k),
                                  "--prompt-len", "8", "--new-tokens", "4"])
    args.k = k
    texts = {}
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), sm90_device_info():
        _, programs = lower_time.build(args)
        _, fn, static, donate, call_args = programs[1]
        for share in (True, False):
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
            with trace_once.scope() if share else contextlib.nullcontext():
                lowered = jitted.trace(*call_args).lower(lowering_platforms=("cuda",))
            texts[share] = lowered.as_text()
    return texts


@pytest.mark.parametrize("k", [0, 2])
def test_gpu_programs_run_the_same_kernels_as_many_times(k):
    """Through the call graph, the shared program launches the same Triton kernels (same IR,
    grid, operands' types) as often as the unshared one, with each lowered once."""
    from benchmarks.lower_time import triton_kernel_calls
    texts = _gpu_program_texts(k)
    shared, plain = (triton_kernel_calls(texts[s]) for s in (True, False))
    assert shared == plain
    layers = 3  # tiny-gqa
    assert sum(plain.values()) >= 5 * layers  # qkv, attention, o, gate/up, down per layer
    lowered = {s: texts[s].count("stablehlo.custom_call @__gpu$xla.gpu.triton") for s in texts}
    assert lowered[False] == sum(plain.values())
    assert lowered[True] == len(shared) < lowered[False]


def test_engine_tokens_do_not_depend_on_sharing(monkeypatch):
    """The pallas backend (interpret mode), plain and speculative: the same greedy tokens with
    and without trace_once, with it each kernel is traced once per program, and XLA inlines
    the shared calls: no call is left in the compiled programs and they copy the KV planes
    exactly as often as without sharing (interpret mode's own copies; none on the GPU)."""
    import re
    from benchmarks.hlo_copies import plane_copies
    from engine_helpers import load, ragged_prompts, tiny_checkpoint
    import pallas_kernels as pk
    from ouro_jax.api import Ouro
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3))
    prompts = ragged_prompts(cfg.vocab_size, [5], seed=2)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    kernel, traces = pk.paged_decode_attention_qkv, []
    monkeypatch.setattr(pk, "paged_decode_attention_qkv",
                        lambda *a, **k: traces.append(1) or kernel(*a, **k))
    runs = {}
    for enabled in (True, False):
        monkeypatch.setattr(trace_once, "ENABLED", enabled)
        traces.clear()
        llm = Ouro(cfg, params, None, page_size=4, attention="pallas")
        runs[enabled] = [[o.token_ids for o in llm.generate(prompts, sp, speculative=s).outputs]
                         for s in (None, SpeculativeConfig(k=2, draft_loops=2))]
        runs[enabled, "traces"] = len(traces)
        runs[enabled, "copies"] = [(r["program"], r["plane_copies"]) for r in plane_copies(llm)]
        texts = [prog.as_text() for prog in llm.programs._programs.values()]
        assert len(texts) >= 4 and not any(re.search(r" call\(", t) for t in texts)
    assert runs[True] == runs[False]
    assert runs[True, "copies"] == runs[False, "copies"]
    # The one-row kernel is called from three places, each once per layer: the native decode
    # step, and in the speculative program the draft's loop body and its last offset
    # (verification runs many rows per sequence, on the other kernel). Shared: one trace per
    # program.
    assert runs[False, "traces"] == 3 * cfg.num_hidden_layers
    assert runs[True, "traces"] == 2
