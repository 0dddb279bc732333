"""Sampling transforms and seeded draws against plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax.sampling import (SamplingArrays, SamplingMode, SamplingParams, processed_logits,
                               row_keys, sample, sampling_arrays, token_logprobs)


def _numpy_processed(logits, temp, top_k, top_p):
    # (shifted by the row's largest logit first: the same distribution, no overflow)
    x = (logits - logits.max()) / temp if temp > 0 else logits.copy()
    if top_k:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    if top_p < 1:
        order = np.argsort(-x)
        p = np.exp(x[order] - x[order][0])
        p /= p.sum()
        above = np.cumsum(p) - p
        keep = order[above < top_p]
        mask = np.full(x.shape, False)
        mask[keep] = True
        x = np.where(mask, x, -np.inf)
    return x


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                              (0.9, 7, 0.6), (0.5, 1, 1.0)])
def test_processed_logits_match_numpy(temp, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 3
    arrays = SamplingArrays(jnp.full((3,), temp, jnp.float32), jnp.full((3,), top_k, jnp.int32),
                            jnp.full((3,), top_p, jnp.float32), jnp.zeros((3,), jnp.uint32))
    mode = SamplingMode(sample=True, top_k=top_k > 0, top_p=top_p < 1)
    got = np.asarray(processed_logits(jnp.asarray(logits), arrays, mode))
    for row in range(3):
        want = _numpy_processed(logits[row], temp, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(want))
        np.testing.assert_allclose(got[row][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)
    if top_k:
        assert (np.isfinite(got).sum(axis=1) <= max(top_k, 1)).all()


@pytest.mark.parametrize("top_p", [1e-40, 1e-45, 1e-30])
def test_a_vanishing_top_p_keeps_the_top_token(top_p):
    """A top_p in (0, 1] that is denormal or 0 in fp32 keeps the most likely token (and its
    exact ties) rather than filtering every token out, which drew token 0 (EOS) silently."""
    from ouro_jax.sampling import sample
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 40)).astype(np.float32)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1.0  # a tie at the top
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in (1, 2)]
    arrays = sampling_arrays(params, 2)
    mode = SamplingMode.for_requests(params)
    got = np.asarray(processed_logits(jnp.asarray(logits), arrays, mode))
    assert list(np.flatnonzero(np.isfinite(got[0]))) == [int(np.argmax(logits[0]))]
    assert list(np.flatnonzero(np.isfinite(got[1]))) == [7, 9]
    tok = np.asarray(sample(jnp.asarray(logits), arrays, mode, jnp.zeros((2,), jnp.int32)))
    assert tok[0] == np.argmax(logits[0]) and tok[1] in (7, 9)


def test_greedy_rows_and_sampled_rows_in_one_batch():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((4, 30)).astype(np.float32))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=6)]
    arrays = sampling_arrays(params, 4)
    mode = SamplingMode.for_requests(params)
    toks = np.asarray(sample(logits, arrays, mode, jnp.arange(4)))
    argmax = np.asarray(jnp.argmax(logits, -1))
    assert toks[0] == argmax[0] and toks[2] == argmax[2]
    # A row's draw depends on its own seed and position only.
    alone = sample(logits[1:2], sampling_arrays(params[1:2], 1), mode, jnp.arange(1, 2))
    assert int(alone[0]) == int(toks[1])


def test_draw_frequencies_follow_the_distribution():
    logits = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05], jnp.float32))
    n = 20000
    arrays = SamplingArrays(jnp.ones((n,), jnp.float32), jnp.zeros((n,), jnp.int32),
                            jnp.ones((n,), jnp.float32), jnp.arange(n, dtype=jnp.uint32))
    toks = sample(jnp.broadcast_to(logits, (n, 4)), arrays, SamplingMode(sample=True),
                  jnp.zeros((n,), jnp.int32))
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_keys_differ_by_seed_position_and_purpose():
    k = row_keys(jnp.asarray([1, 1, 2], jnp.uint32), jnp.asarray([3, 4, 3]), 0)
    k2 = row_keys(jnp.asarray([1], jnp.uint32), jnp.asarray([3]), 1)
    data = [tuple(np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                             else x).ravel()) for x in (k[0], k[1], k[2], k2[0])]
    assert len(set(data)) == 4


def test_token_logprobs_are_log_softmax():
    logits = jnp.asarray([[1.0, 2.0, 3.0]])
    lp = token_logprobs(logits, jnp.asarray([2]))
    np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits)[0, 2]), rtol=1e-6)


@pytest.mark.parametrize("kw,msg", [(dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
                                    (dict(temperature=-1.0), "temperature"),
                                    (dict(temperature=float("nan")), "temperature"),
                                    (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"),
                                    (dict(seed=-1), "seed")])
def test_invalid_sampling_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("temp", [2e-38, 1.2e-38])
def test_a_tiny_temperature_draws_the_largest_logit(temp):
    """Dividing the raw logits by 2e-38 overflowed several to +inf, and the draw went to the
    first of those ties (token 1 here, not the argmax 3)."""
    logits = jnp.array([[0.0, 5.0, 4.0, 9.0, -2.0]], jnp.float32)
    arrays = SamplingArrays(jnp.full((1,), temp, jnp.float32), jnp.zeros((1,), jnp.int32),
                            jnp.ones((1,), jnp.float32), jnp.zeros((1,), jnp.uint32))
    mode = SamplingMode(sample=True)
    x = np.asarray(processed_logits(logits, arrays, mode))
    assert x[0, 3] == 0 and np.all(x[0, [0, 1, 2, 4]] < -1e37)  # (or -inf)
    for pos in range(8):
        assert int(sample(logits, arrays, mode, jnp.array([pos]))[0]) == 3


def test_top_k_beyond_int32_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1.0, top_k=2**31)
    assert SamplingParams(temperature=1.0, top_k=2**31 - 1).top_k == 2**31 - 1


def test_an_infinite_logit_keeps_its_draw_under_the_filters():
    """The max shift is skipped for a row whose largest logit is not finite (inf - inf
    would make the row NaN and the filters would drop every token)."""
    logits = jnp.array([[1.0, jnp.inf, 3.0, 2.0]], jnp.float32)
    arrays = SamplingArrays(jnp.full((1,), 0.7, jnp.float32), jnp.full((1,), 2, jnp.int32),
                            jnp.full((1,), 0.9, jnp.float32), jnp.zeros((1,), jnp.uint32))
    mode = SamplingMode(sample=True, top_k=True, top_p=True)
    assert int(sample(logits, arrays, mode, jnp.array([3]))[0]) == 1


def test_flags_take_bools_of_any_kind_but_not_strings():
    assert SamplingParams(ignore_eos=np.array(True), logprobs=np.True_).ignore_eos is True
    assert SamplingParams(ignore_eos=1, logprobs=0).logprobs is False
    for bad in ("no", "false", 2, 0.5):
        with pytest.raises(ValueError, match="ignore_eos must be True or False"):
            SamplingParams(ignore_eos=bad)
