"""ouro_jax: a JAX/XLA inference engine for Ouro looped language models."""

from ouro_jax.config import OuroConfig
from ouro_jax.sampling import SamplingParams


def __getattr__(name):  # keep `import ouro_jax` light: the engine loads on first use
    if name in ("Ouro", "GenerationResult", "RequestOutput", "GenerationStats"):
        from ouro_jax import api
        return getattr(api, name)
    if name == "SpeculativeConfig":
        from ouro_jax.speculative import SpeculativeConfig
        return SpeculativeConfig
    raise AttributeError(name)


__all__ = ["Ouro", "OuroConfig", "SamplingParams", "SpeculativeConfig", "GenerationResult",
           "RequestOutput", "GenerationStats"]
