"""Jitted generation: prefill, then a ``lax.while_loop`` of decode steps over a named state.

``generate_tokens`` works on token arrays; ``generate`` on text with a loaded model
(tokenizer, chat template, stop tokens).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import eviction, kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.kvcache import KVCache
from jaxkv.model import decoder
from jaxkv.topn import top_p_mask

PAD_MULTIPLE = 64  # prompts are padded to a multiple of this: fewer distinct compiled shapes


@struct.dataclass
class DecodeState:
    """Carry of the decode loop.

    Attributes:
        cache: the KV cache.
        tokens: [B, N] generated tokens (pad after a sequence stops).
        next_token: [B] token fed at the next step.
        done: [B] bool, sequence has emitted a stop token.
        step: [] int32 number of tokens generated so far.
        keep_rows: [L, B, K] bool rows exempt from eviction (head-level hybrid), or None.
    """

    cache: KVCache
    tokens: jax.Array
    next_token: jax.Array
    done: jax.Array
    step: jax.Array
    keep_rows: jax.Array | None = None


@struct.dataclass
class Sampling:
    """Sampling settings. ``temperature == 0`` means greedy (static: decides the graph)."""

    temperature: float = struct.field(pytree_node=False, default=0.0)
    top_p: float = struct.field(pytree_node=False, default=1.0)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = Sampling()


def sample(logits_BV: jax.Array, sampling: Sampling, *, key: jax.Array) -> jax.Array:
    """Greedy argmax, or temperature + nucleus (top-p) sampling."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / sampling.temperature
    if sampling.top_p < 1:
        logits = jnp.where(top_p_mask(logits, sampling.top_p), logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _is_stop(token_B, stop_tokens: tuple[int, ...]):
    if not stop_tokens:
        return jnp.zeros(token_B.shape, bool)
    return jnp.isin(token_B, jnp.asarray(stop_tokens, jnp.int32))


def decode_loop(
    params: dict,
    state: DecodeState,
    *,
    config: ModelConfig,
    sampling: Sampling,
    stop_tokens: tuple[int, ...],
    pad_id: int,
    key: jax.Array,
    compression: Compression | None = None,
    policy_state=None,
) -> DecodeState:
    """Decodes until every sequence stopped or ``tokens`` is full, evicting as it goes
    (``decode`` protocol; under ``prefill`` the cache only grows).

    The token of each step comes from the unpruned pass; eviction then prepares the cache
    for the next step (paper Alg. 1).
    """
    max_new = state.tokens.shape[1]
    sample_key, evict_key = jax.random.split(key)

    def cond(s: DecodeState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def body(s: DecodeState):
        tokens = s.tokens.at[:, s.step].set(jnp.where(s.done, pad_id, s.next_token))
        done = s.done | _is_stop(s.next_token, stop_tokens)
        logits, cache = decoder.decode_step(params, s.next_token, s.cache, config=config)
        if compression is not None and compression.evicts_in_decode:
            due = (s.step + 1) % compression.evict_every == 0
            cache = jax.lax.cond(
                due,
                lambda c: eviction.evict(
                    c,
                    compression,
                    policy_state,
                    key=jax.random.fold_in(evict_key, s.step),
                    max_drop=compression.evict_every,
                    keep_rows=s.keep_rows,
                    kernel=config.attention == "kernel",
                ),
                lambda c: c,
                cache,
            )
        nxt = sample(logits, sampling, key=jax.random.fold_in(sample_key, s.step + 1))
        return s.replace(cache=cache, tokens=tokens, next_token=nxt, done=done, step=s.step + 1)

    return jax.lax.while_loop(cond, body, state)


def prefill_compressed(
    params, prompt_BT, lengths_B, cache, *, config, compression, policy_state, key, capacity
):
    """Prefill, then evict down to the budget and compact into ``capacity`` slots.

    Returns:
        Last-token logits [B, V], the compressed cache, and the hybrid's exempt rows.
    """
    logits, cache = decoder.prefill(params, prompt_BT, cache, config=config, lengths_B=lengths_B)
    keep_rows = None
    if compression is not None and compression.policy.evicts:
        keep_rows = eviction.hybrid_full_rows(cache, compression)
        cache = eviction.evict(
            cache,
            compression,
            policy_state,
            key=key,
            max_drop=cache.capacity,
            keep_rows=keep_rows,
            kernel=config.attention == "kernel",
        )
    if cache.capacity > capacity:
        cache = kvcache.compact(cache, capacity)
    return logits, cache, keep_rows


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "max_new_tokens",
        "sampling",
        "stop_tokens",
        "pad_id",
        "compression",
        "capacity",
    ),
    donate_argnames=("cache",),
)
def _generate_jit(
    params,
    prompt_BT,
    lengths_B,
    cache,
    key,
    policy_state,
    *,
    config,
    max_new_tokens,
    sampling,
    stop_tokens,
    pad_id,
    compression,
    capacity,
):
    prefill_key, loop_key, evict_key = jax.random.split(key, 3)
    logits, cache, keep_rows = prefill_compressed(
        params,
        prompt_BT,
        lengths_B,
        cache,
        config=config,
        compression=compression,
        policy_state=policy_state,
        key=evict_key,
        capacity=capacity,
    )
    B = prompt_BT.shape[0]
    state = DecodeState(
        cache=cache,
        tokens=jnp.full((B, max_new_tokens), pad_id, jnp.int32),
        next_token=sample(logits, sampling, key=prefill_key),
        done=jnp.zeros((B,), bool),
        step=jnp.zeros((), jnp.int32),
        keep_rows=keep_rows,
    )
    return decode_loop(
        params,
        state,
        config=config,
        sampling=sampling,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        key=loop_key,
        compression=compression,
        policy_state=policy_state,
    )


def generate_tokens(
    params: dict,
    prompts: Sequence[Sequence[int]],
    *,
    config: ModelConfig,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    key: jax.Array | None = None,
    compression: Compression | None = None,
    policy_state=None,
    kv_dtype=None,
) -> list[list[int]]:
    """Generates from a batch of token-id prompts (different lengths allowed).

    Args:
        params: model parameters.
        prompts: token-id lists.
        config: the model config.
        max_new_tokens: generated tokens at most.
        sampling: greedy (default) or temperature/top-p.
        stop_tokens: ids that end a sequence (kept in its output).
        pad_id: id written after a sequence stopped.
        key: PRNG key for sampling and random policies.
        compression: KV-cache compression (None: full cache).
        policy_state: the policy's state (when None, the policy's ``init()``).
        kv_dtype: the cache's key/value dtype (``kvcache.init_cache``'s ``dtype``: None for
            the model's, ``"int8"`` for an int8 cache).

    Returns:
        For each prompt, the generated ids up to and including the first stop token.
    """
    prompt_BT, lengths_B = pad_prompts(prompts, vocab_size=config.vocab_size)
    n_max = prompt_BT.shape[1] + max_new_tokens
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if n_max > config.max_seq_len:
        raise ValueError(
            f"prompt ({int(lengths_B.max())} tokens, padded to {prompt_BT.shape[1]}) + "
            f"{max_new_tokens} new tokens exceeds the model's max_seq_len {config.max_seq_len}"
        )
    capacity, cache, policy_state = _run_cache(
        params,
        config,
        len(prompts),
        n_max,
        prompt_BT.shape[1],
        compression,
        policy_state,
        kv_dtype=kv_dtype,
    )
    with warnings.catch_warnings():
        # a prompt longer than the compressed capacity is compacted into a smaller cache,
        # so the donated prefill buffers cannot be reused: expected, not a problem
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        state = _generate_jit(
            params,
            prompt_BT,
            lengths_B,
            cache,
            jax.random.key(0) if key is None else key,
            policy_state,
            config=config,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_tokens=tuple(int(t) for t in stop_tokens),
            pad_id=int(pad_id),
            compression=compression,
            capacity=capacity,
        )
    return _trim(np.asarray(state.tokens), np.asarray(state.step), set(stop_tokens))


def _run_cache(params, config, batch, n_max, prompt_len, compression, policy_state, *, kv_dtype):
    """(loop capacity, prefill cache, policy state) of a run of ``n_max`` tokens: the
    prefill cache holds the whole prompt, the loop cache the compressed capacity; keys and
    values in ``kv_dtype`` (None: the model's)."""
    capacity = n_max
    if compression is not None:
        capacity = compression.capacity(n_max, prompt_len=prompt_len)
    evicts = compression is not None and compression.policy.evicts
    if compression is not None and policy_state is None:
        policy_state = compression.policy.init()
    cache = kvcache.init_cache(
        config,
        batch_size=batch,
        capacity=max(capacity, prompt_len),
        dtype=kv_dtype,
        stats=() if compression is None else compression.stats,
        window=compression.policy.window if evicts else 64,
    )
    return capacity, cache, policy_state


def _trim(tokens_BN: np.ndarray, n_steps: int, stops: set[int]) -> list[list[int]]:
    out = []
    for row in tokens_BN[:, : int(n_steps)].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append(row[:cut])
    return out


def pad_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int):
    """Right-pads prompts to a multiple of ``PAD_MULTIPLE``; validates every id.

    Returns:
        tokens [B, T] int32 and lengths [B] int32 (jax arrays).
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    rows = [np.asarray(p) for p in prompts]
    for i, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"prompt {i} is empty or not a 1-D sequence of token ids")
        if not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"prompt {i} has dtype {row.dtype}; token ids must be integers")
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}): min {row.min()}, "
                f"max {row.max()}"
            )
    longest = max(r.size for r in rows)
    T = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    tokens = np.zeros((len(rows), T), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : row.size] = row
    lengths = np.asarray([r.size for r in rows], np.int32)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt, wrapped in the tokenizer's chat template when ``chat``."""
    if not prompt:
        raise ValueError("empty prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass chat=False")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """EOS plus the chat end-of-turn token when the vocabulary has one."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "</s>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return tuple(sorted(i for i in ids if i is not None))


def generate(
    model,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 128,
    chat: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    policy: str | None = None,
    ratio: float | None = None,
    budget: int | None = None,
    kv_dtype: str | None = None,
    **compression_options,
) -> list[str]:
    """Generates text for one or several prompts with a loaded model (``jaxkv.load``).

    Args:
        model: a ``LoadedModel`` (config, params, tokenizer).
        prompts: a prompt or a list of prompts.
        max_new_tokens: upper bound on generated tokens per prompt.
        chat: wrap prompts in the model's chat template.
        temperature: 0 for greedy decoding; otherwise sampling temperature.
        top_p: nucleus-sampling mass.
        seed: sampling seed.
        policy: eviction policy name (``jaxkv.policies.policy_names()``); None = full cache.
        ratio: budget ratio r in (0, 1] (with ``policy``).
        budget: absolute budget instead of ``ratio``.
        kv_dtype: None (the model's dtype) or ``"int8"`` (an int8 KV cache).
        **compression_options: further ``Compression`` fields (granularity, min_budget, ...).

    Returns:
        The decoded completions (stop tokens removed).
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    compression = None
    if policy is not None:
        compression = Compression.make(policy, ratio=ratio, budget=budget, **compression_options)
    ids = [encode_prompt(model.tokenizer, p, chat=chat) for p in prompts]
    stops = stop_token_ids(model.tokenizer)
    pad = model.tokenizer.pad_token_id
    outs = generate_tokens(
        model.params,
        ids,
        config=model.config,
        max_new_tokens=max_new_tokens,
        sampling=Sampling(temperature=temperature, top_p=top_p),
        stop_tokens=stops,
        pad_id=stops[0] if pad is None else pad,
        key=jax.random.key(seed),
        compression=compression,
        kv_dtype=kv_dtype,
    )
    return [model.tokenizer.decode(o, skip_special_tokens=True) for o in outs]


@functools.partial(jax.jit, static_argnames=("config", "prompt_len", "compression", "capacity"))
def _teacher_forced_jit(
    params, tokens_BT, cache, key, policy_state, *, config, prompt_len, compression, capacity
):
    prefill_key, evict_key = jax.random.split(key)
    logits, cache, keep_rows = prefill_compressed(
        params,
        tokens_BT[:, :prompt_len],
        None,
        cache,
        config=config,
        compression=compression,
        policy_state=policy_state,
        key=prefill_key,
        capacity=capacity,
    )

    def step(cache, xs):
        i, token_B = xs
        out, cache = decoder.decode_step(params, token_B, cache, config=config)
        if compression is not None and compression.evicts_in_decode:
            due = (i + 1) % compression.evict_every == 0
            cache = jax.lax.cond(
                due,
                lambda c: eviction.evict(
                    c,
                    compression,
                    policy_state,
                    key=jax.random.fold_in(evict_key, i),
                    max_drop=compression.evict_every,
                    keep_rows=keep_rows,
                    kernel=config.attention == "kernel",
                ),
                lambda c: c,
                cache,
            )
        return cache, out

    rest = tokens_BT[:, prompt_len:-1].T
    cache, outs = jax.lax.scan(step, cache, (jnp.arange(rest.shape[0]), rest))
    return jnp.concatenate([logits[:, None], jnp.moveaxis(outs, 0, 1)], axis=1), cache


def teacher_forced(
    params: dict,
    tokens_BT: jax.Array,
    *,
    prompt_len: int,
    config: ModelConfig,
    compression: Compression | None = None,
    policy_state=None,
    key: jax.Array | None = None,
    kv_dtype=None,
):
    """Logits of a compressed cache fed a fixed token stream (teacher forcing).

    The first ``prompt_len`` tokens are prefilled (then evicted down to the budget); each
    later token is decoded one at a time, with eviction after every step under the
    ``decode`` protocol and none under ``prefill``, as in generation. ``kv_dtype`` is the
    cache's key/value dtype (None: the model's; ``"int8"``: an int8 cache).

    Returns:
        Logits [B, T - prompt_len, V] predicting tokens ``prompt_len .. T-1`` (the same
        positions as ``forward(...)[:, prompt_len - 1 : -1]``), and the final cache.
    """
    B, T = tokens_BT.shape
    if not 0 < prompt_len < T:
        raise ValueError(f"prompt_len must be in [1, {T - 1}], got {prompt_len}")
    capacity, cache, policy_state = _run_cache(
        params, config, B, T, prompt_len, compression, policy_state, kv_dtype=kv_dtype
    )
    return _teacher_forced_jit(
        params,
        jnp.asarray(tokens_BT, jnp.int32),
        cache,
        jax.random.key(0) if key is None else key,
        policy_state,
        config=config,
        prompt_len=prompt_len,
        compression=compression,
        capacity=capacity,
    )


@functools.partial(jax.jit, static_argnames=("config", "prompt_len"))
def _full_cache_attention_jit(params, tokens_BT, cache, *, config, prompt_len):
    _, cache = decoder.prefill(params, tokens_BT[:, :prompt_len], cache, config=config)

    def step(cache, token_B):
        _, cache = decoder.decode_step(params, token_B, cache, config=config)
        return cache, cache.stats["attn"]

    _, attn_QLBKS = jax.lax.scan(step, cache, tokens_BT[:, prompt_len:-1].T)
    return attn_QLBKS


def full_cache_attention(
    params: dict, tokens_BT: jax.Array, *, prompt_len: int, config: ModelConfig
) -> jax.Array:
    """The attention of a teacher-forced stream's queries under the full cache: what the
    ``oracle`` policy reads (``jaxkv.policies.oracle.future_attention``).

    The same run as ``teacher_forced`` without compression, whose decode steps feed the
    tokens at positions ``prompt_len .. T-2``. Its cache never evicts and has no padding, so
    slot s holds position s, and the ``attn`` statistic after each step (the step's query,
    mean over the KV group's query heads) is that query's attention over positions.

    Returns:
        [T - prompt_len - 1, L, B, K, T] float32: row i is the attention of the query at
        position ``prompt_len + i`` (zero on positions after it).
    """
    B, T = tokens_BT.shape
    if not 0 < prompt_len < T:
        raise ValueError(f"prompt_len must be in [1, {T - 1}], got {prompt_len}")
    cache = kvcache.init_cache(config, batch_size=B, capacity=T, stats=("attn",))
    return _full_cache_attention_jit(
        params, jnp.asarray(tokens_BT, jnp.int32), cache, config=config, prompt_len=prompt_len
    )
