"""Model configuration: frozen dataclasses with named presets.

Axis glossary (used in shape suffixes across jaxkv, e.g. ``k_LBKCH``):

    L  layers               B  batch               K  KV heads
    G  query heads per KV   N  query heads (K*G)   C  cache slots
    T  tokens (sequence)    S  key positions       H  head dim
    D  model dim            F  MLP hidden dim      V  vocabulary

KVLearn (``jaxkv/kvlearn``: the KV pool of a disaggregated serving system; no letter above is
reused with another meaning):

    P  prefix keys: key ids with a history row (serving: dense block ids, one per chained
       prefix hash)
    R  requests                             E  victims one admission evicts
    Z  slots of the pool's block table      Y  slot groups of the victim search (Z = Y·W)
    W  slots per group                      J  columns of the per-key history table
    I  PRP input features (16)              U  hidden units of the PRP's MLP
    M  replay-buffer rows                   A  Adam steps in one PRP training round
    Q  runs trained together in one batched round (``prp.maybe_train_batch``)
    B  (as above) a PRP minibatch, or independent simulator runs under ``vmap``

(``PRPState``'s fields keep ``F`` for the feature axis, ``mean_F`` / ``buf_x_MF``: they are the
keypaths of saved PRP checkpoints; see ``jaxkv/kvlearn/core/prp.py``.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLEMENTATIONS = ("xla", "kernel")
"""How a decode step attends over the cache, and a prompt over itself: ``xla`` (jax.numpy,
every backend) or ``kernel`` (``jaxkv.model.cache_kernel``, compiled CPU kernels: decode
steps read each cached key and value once, float32, float16 or int8, and return the slots'
probabilities when the cache's statistics need them; a float32 prompt with a head size that
is a multiple of 64 goes through a flash-style causal kernel)."""
MATMUL_IMPLEMENTATIONS = ("xla", "kernel")
"""How a decode step with 1-16 rows (a batch) multiplies by the layers' weights: ``xla``, or
``kernel`` (``jaxkv.model.cache_kernel.stacked_matmul``, a compiled CPU kernel that reads each
layer's out-first float32 or int8 weights in place, where XLA copies the layer's slice first,
and at one row reads each output channel's weights as one stream). Prefill always uses XLA."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Mistral/Llama-style decoder.

    ``sliding_window`` is ``None`` for full attention; otherwise a query at
    position p sees keys at positions ``p - sliding_window < q <= p`` (HF Mistral).
    ``attention`` is one of ``ATTENTION_IMPLEMENTATIONS``, ``matmul`` one of
    ``MATMUL_IMPLEMENTATIONS``.
    """

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: int | None = None
    tie_embeddings: bool = False
    max_seq_len: int = 32768
    dtype: str = "float32"
    attention: str = "xla"
    matmul: str = "xla"

    def __post_init__(self):
        positive = (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
        )
        bad = [f for f in positive if getattr(self, f) <= 0]
        if bad:
            raise ValueError(f"ModelConfig {self.name!r}: fields must be positive: {bad}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig {self.name!r}: sliding_window must be positive or None")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"ModelConfig {self.name!r}: attention {self.attention!r} not in "
                f"{ATTENTION_IMPLEMENTATIONS}"
            )
        if self.matmul not in MATMUL_IMPLEMENTATIONS:
            raise ValueError(
                f"ModelConfig {self.name!r}: matmul {self.matmul!r} not in {MATMUL_IMPLEMENTATIONS}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"ModelConfig {self.name!r}: dtype {self.dtype!r} not in {sorted(_DTYPES)}"
            )

    @property
    def q_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def mistral_7b_v03(cls) -> ModelConfig:
        """Mistral-7B-Instruct-v0.3 (no sliding window, 32768 vocab)."""
        return cls(
            name="mistral-7b-v0.3",
            vocab_size=32768,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            d_ff=14336,
            rope_theta=1e6,
            norm_eps=1e-5,
        )

    @classmethod
    def mistral_7b_v01(cls) -> ModelConfig:
        """Mistral-7B-v0.1: 32000 vocab, rope theta 1e4, sliding window 4096."""
        return cls.mistral_7b_v03().replace(
            name="mistral-7b-v0.1", vocab_size=32000, rope_theta=1e4, sliding_window=4096
        )

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        """SmolLM2-135M-Instruct (Llama architecture, tied embeddings)."""
        return cls(
            name="smollm2-135m",
            vocab_size=49152,
            d_model=576,
            n_layers=30,
            n_heads=9,
            n_kv_heads=3,
            head_dim=64,
            d_ff=1536,
            rope_theta=1e5,
            norm_eps=1e-5,
            tie_embeddings=True,
            max_seq_len=8192,
        )

    @classmethod
    def tiny(cls, **changes) -> ModelConfig:
        """A 2-layer toy model for tests (GQA, G=2)."""
        base = cls(
            name="tiny",
            vocab_size=256,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            d_ff=128,
            rope_theta=10000.0,
            norm_eps=1e-5,
            max_seq_len=1024,
        )
        return base.replace(**changes)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """Looks up a preset by name (``mistral-7b-v0.3``, ``smollm2-135m``, ...)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]()

    # ---- HF config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | Path, *, name: str | None = None) -> ModelConfig:
        """Builds a config from a HF ``config.json`` (dict or path) of a Mistral or Llama model.

        Raises:
            ValueError: naming every unsupported setting (bias terms, rope scaling, other
                activations or architectures).
        """
        if not isinstance(hf, dict):
            path = Path(hf)
            if path.is_dir():
                path = path / "config.json"
            try:
                hf = json.loads(path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"no HF config at {path}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls(**_hf_fields(hf, name))


def _hf_fields(hf: dict[str, Any], name: str | None) -> dict[str, Any]:
    model_type = hf.get("model_type")
    problems = []
    if model_type not in ("mistral", "llama"):
        problems.append(f"model_type={model_type!r} (supported: 'mistral', 'llama')")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (supported: 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=True (bias terms are not supported)")
    rope_params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope_params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        problems.append(f"rope scaling {rope_type!r} (only plain RoPE is supported)")
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    if head_dim * n_heads != hf["hidden_size"] and model_type == "llama" and "head_dim" not in hf:
        problems.append("hidden_size is not divisible by num_attention_heads")
    if problems:
        raise ValueError("unsupported HF config settings: " + "; ".join(problems))
    theta = hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    window = hf.get("sliding_window") if model_type == "mistral" else None
    return dict(
        name=name or hf.get("_name_or_path") or model_type,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        d_ff=hf["intermediate_size"],
        rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        sliding_window=window,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 32768)),
    )


PRESETS = {
    "mistral-7b-v0.3": ModelConfig.mistral_7b_v03,
    "mistral-7b-v0.1": ModelConfig.mistral_7b_v01,
    "smollm2-135m": ModelConfig.smollm2_135m,
    "tiny": ModelConfig.tiny,
}
