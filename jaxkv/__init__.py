"""jaxkv: learned KV-cache management for LLM inference in JAX.

The public API:

* ``ModelConfig``: model shapes and presets.
* ``load(name_or_path)``: a ``LoadedModel`` (config, params, tokenizer); ``"smollm2-135m"`` is
  the embedded model.
* ``forward``, ``prefill``, ``extend``, ``decode_step``: the pure decoder.
* ``KVCache``, ``init_cache``, ``append``, ``gather``: the explicit cache pytree.
* ``generate`` (text) and ``generate_tokens`` (ids): jitted generation.
"""

from jaxkv.config import ModelConfig
from jaxkv.generate import Sampling, generate, generate_tokens
from jaxkv.kvcache import KVCache, append, gather, init_cache
from jaxkv.model.decoder import decode_step, extend, forward, prefill
from jaxkv.model.loading import LoadedModel
from jaxkv.model.loading import load_model as load
from jaxkv.model.params import count_params, init_params

__all__ = [
    "KVCache",
    "LoadedModel",
    "ModelConfig",
    "Sampling",
    "append",
    "count_params",
    "decode_step",
    "extend",
    "forward",
    "gather",
    "generate",
    "generate_tokens",
    "init_cache",
    "init_params",
    "load",
    "prefill",
]
