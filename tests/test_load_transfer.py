"""How the loader hands weights to the device (ouro_jax.params._Put): no aliasing of a
caller's arrays or of a memory-mapped file on a CPU, no host copy where the transfer copies
anyway, and the pinned-memory route with its fallback."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax.config import TINY_MQA_ODD
from ouro_jax.params import GLOBAL_TENSORS
from test_checkpoint import BF16, assert_bits_equal, tensors_for


def test_engine_weights_do_not_alias_a_callers_arrays():
    """Arrays handed in (same dtype, owned by the caller) are copied: changing them later
    leaves the weights as they were."""
    from ouro_jax.params import engine_params_from_hf
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg, BF16)
    params = engine_params_from_hf(tensors, cfg, jnp.bfloat16, fuse=False)
    before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(params)]
    for arr in tensors.values():
        arr[...] = 7
    for a, b in zip(jax.tree_util.tree_leaves(params), before):
        assert_bits_equal(np.asarray(a), b)


@pytest.mark.parametrize("fuse", [True, False])
def test_engine_weights_do_not_alias_a_memory_mapped_file(tmp_path, fuse):
    """Weights built from memory-mapped tensors keep their values when the file is rewritten
    in place. On a CPU jax.device_put keeps a view of an aligned input; here every tensor
    sits at a 64-byte-aligned offset of one file, so a view would see the rewrite."""
    from ouro_jax.params import engine_params_from_hf
    cfg = TINY_MQA_ODD
    path = tmp_path / "raw.bin"

    def write(tensors):
        offsets, pos = {}, 0
        with open(path, "r+b" if path.exists() else "wb") as f:
            for name, arr in sorted(tensors.items()):
                f.seek(pos)
                f.write(arr.tobytes())
                offsets[name] = pos
                pos += -(-arr.nbytes // 64) * 64
        return offsets

    first = tensors_for(cfg, BF16)
    offsets = write(first)
    mapped = {n: np.memmap(path, BF16, "r", offsets[n], first[n].shape) for n in first}
    params = engine_params_from_hf(mapped, cfg, jnp.bfloat16, fuse=fuse)
    before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(params)]
    write(tensors_for(cfg, BF16, seed=1))  # other values, same offsets, in place
    assert not np.array_equal(np.asarray(mapped[sorted(first)[0]]), first[sorted(first)[0]])
    for a, b in zip(jax.tree_util.tree_leaves(params), before):
        assert_bits_equal(np.asarray(a), b)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("stacked", [True, False])
def test_host_copies_only_where_device_put_may_alias(platform, stacked, monkeypatch):
    """On a CPU the tensors handed in (same dtype, so not cast) go to jax.device_put as
    copies; on a GPU device_put itself copies into device memory, so they go as they are (a
    second host pass over 1.15 GB of the 1.4B model's mapped bytes, skipped). Either way
    the seconds spent in device_put are counted in times["put_s"]."""
    from ouro_jax import params as params_mod
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg, BF16)
    seen, real = [], jax.device_put
    monkeypatch.setattr(params_mod, "_default_platform", lambda: platform)
    monkeypatch.setattr(params_mod.jax, "device_put", lambda x, *a, **k: (
        seen.append(x), real(x, *a, **k))[1])
    times = {}
    build = (params_mod.params_from_hf if stacked else
             functools.partial(params_mod.engine_params_from_hf, fuse=False))
    build(tensors, cfg, jnp.bfloat16, times=times)
    views = [x for x in seen if any(x is t for t in tensors.values())]
    shared = [x for x in seen if any(np.shares_memory(x, t) for t in tensors.values())]
    # stacked: only the global tensors go as they are; per layer: every tensor
    assert len(views) == len(shared) == (0 if platform == "cpu" else
                                         len(GLOBAL_TENSORS) if stacked else len(tensors))
    assert times["put_s"] > 0


def test_pinned_staging_gives_the_same_weights_in_device_memory(monkeypatch):
    """With PINNED_STAGING each tensor goes to the device's pinned host memory, then to the
    device: the same bits as the plain path, every weight in device memory. (The CPU has a
    pinned_host memory too, so the route runs here with the platform check faked.)"""
    from ouro_jax import params as params_mod
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg, BF16)
    plain = params_mod.engine_params_from_hf(tensors, cfg, jnp.bfloat16)
    dev = jax.devices()[0]
    S = jax.sharding.SingleDeviceSharding
    monkeypatch.setattr(params_mod, "_default_platform", lambda: "gpu")
    monkeypatch.setattr(params_mod, "_pinned_shardings", lambda: (
        S(dev, memory_kind="pinned_host"), S(dev)))
    kinds, real = [], jax.device_put
    monkeypatch.setattr(params_mod.jax, "device_put", lambda x, s=None, **k: (
        kinds.append(getattr(s, "memory_kind", None)), real(x, s, **k))[1])
    staged = params_mod.engine_params_from_hf(tensors, cfg, jnp.bfloat16)
    leaves = jax.tree_util.tree_leaves(staged)
    assert kinds.count("pinned_host") == len(leaves)  # every weight staged once
    for a, b in zip(leaves, jax.tree_util.tree_leaves(plain)):
        assert a.sharding.memory_kind in (None, "device")
        assert_bits_equal(np.asarray(a), np.asarray(b))
    monkeypatch.setattr(params_mod, "PINNED_STAGING", False)  # the switch turns it off
    kinds.clear()
    params_mod.engine_params_from_hf(tensors, cfg, jnp.bfloat16)
    assert "pinned_host" not in kinds
    monkeypatch.setattr(params_mod, "PINNED_STAGING", True)

    def no_pinned(x, s=None, **k):  # pinned memory refused: one warning, the pageable path
        if getattr(s, "memory_kind", None) == "pinned_host":
            raise RuntimeError("RESOURCE_EXHAUSTED: pinned host memory")
        return real(x, s, **k)
    monkeypatch.setattr(params_mod.jax, "device_put", no_pinned)
    with pytest.warns(RuntimeWarning, match="pinned host memory failed") as seen:
        fallback = params_mod.engine_params_from_hf(tensors, cfg, jnp.bfloat16)
    assert len(seen) == 1
    for a, b in zip(jax.tree_util.tree_leaves(fallback), jax.tree_util.tree_leaves(plain)):
        assert_bits_equal(np.asarray(a), np.asarray(b))
