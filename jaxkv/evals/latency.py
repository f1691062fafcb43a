"""Latency per decode step and throughput (paper Table 3), measured piece by piece.

For each ratio a prompt batch of ``--context`` tokens is prefilled and evicted to the budget
(the full cache keeps everything), giving the cache a decode step sees. Jitted pieces are then
timed separately on that cache (medians over ``--repeats`` × ``STEPS_PER_REPEAT`` calls, after a
warm-up call that compiles):

* ``attn_ms``: one decode step (the whole model: projections, attention over the cache, MLP,
  logits) on a cache without statistics — what the step costs at that cache size;
* ``feature_ms``: the same step with the in-attention statistics the policy reads
  (``Policy.stats``), minus ``attn_ms``;
* ``policy_ms``: the policy's scoring (for learned policies: building the five features from
  those statistics and running the MLP) plus the top-B selection and slot freeing
  (``eviction.evict``, one eviction per step);
* ``tokens_per_s``: end to end, ``batch × new_tokens`` / the wall time of ``generate_tokens``
  (prefill, decoding, eviction, host transfer); ``decode_tokens_per_s`` leaves the prefill out.

The full cache has no feature or policy cost. On a shared 2-core CPU timings vary up to 2×
between runs: compare rows of one run, not across runs. ``evaluate`` is the whole job
(``python -m jaxkv.eval latency``).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import eviction, kvcache
from jaxkv.evals import report, runner, tasks
from jaxkv.evals.runner import (
    EvalModel,
    Job,
    PolicyGroup,
    generate_ids,
    switch_compression,
    switch_policy,
    switch_state,
)
from jaxkv.eviction import Compression
from jaxkv.generate import GREEDY, prefill_compressed, sample
from jaxkv.model import decoder

NAME = "latency"
STEPS_PER_REPEAT = 5


def median_ms(fn: Callable[[], object], *, repeats: int, calls: int = STEPS_PER_REPEAT) -> float:
    """Median wall time of ``fn()`` in ms (one warm-up call first; results are blocked on)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        for _ in range(calls):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


@functools.partial(jax.jit, static_argnames=("config", "compression", "capacity"))
def _prefill(params, prompt_BT, cache, key, state, *, config, compression, capacity):
    _, cache, _ = prefill_compressed(
        params,
        prompt_BT,
        None,
        cache,
        config=config,
        compression=compression,
        policy_state=state,
        key=key,
        capacity=capacity,
    )
    return cache


def decode_and_forget(params, token_B, cache, *, config):
    """One decode step, then the slot it wrote freed again, so that repeated calls time the
    same step at the same cache size. Returns the cache and the logits' greedy token (the
    logits are part of the step: unused, XLA would drop the vocabulary projection).
    ``scripts/bench_eviction.py`` and ``scripts/profile_decode.py`` time the same step inside
    their fused loops."""
    logits, cache = decoder.decode_step(params, token_B, cache, config=config)
    newest = cache.pos == (cache.length - 1)[None, :, None, None]
    cache = cache.replace(pos=jnp.where(newest, kvcache.FREE, cache.pos), length=cache.length - 1)
    return cache, sample(logits, GREEDY, key=None)


# The step on a donated cache (written in place, not copied).
_decode_and_forget = jax.jit(
    decode_and_forget, static_argnames=("config",), donate_argnames=("cache",)
)


@functools.partial(jax.jit, static_argnames=("compression",))
def _evict(cache, state, key, *, compression):
    return eviction.evict(cache, compression, state, key=key, max_drop=compression.evict_every)


def prepared_cache(model: EvalModel, prompt_BT, *, compression, state, n_max: int):
    """The cache after a jitted prefill + eviction (none for the full cache, which also carries
    no statistics), with room for the next tokens."""
    capacity = n_max if compression is None else compression.capacity(n_max)
    cache = kvcache.init_cache(
        model.config,
        batch_size=prompt_BT.shape[0],
        capacity=max(capacity, prompt_BT.shape[1]),
        stats=() if compression is None else compression.stats,
    )
    return _prefill(
        model.params,
        prompt_BT,
        cache,
        jax.random.key(0),
        state,
        config=model.config,
        compression=compression,
        capacity=capacity,
    )


def step_ms(params, cache, *, config, repeats: int, stats=()) -> float:
    """Median ms of a decode step on ``cache`` carrying only the statistics ``stats``."""
    token = jnp.zeros((cache.batch_size,), jnp.int32)
    lean = jax.tree.map(jnp.copy, cache.replace(stats={n: cache.stats[n] for n in stats}))
    box = [lean, token]  # each call donates the cache the last one returned

    def step():
        box[:] = _decode_and_forget(params, box[1], box[0], config=config)
        return box[1]

    return median_ms(step, repeats=repeats)


def prefill_ms(model: EvalModel, prompt_BT, *, compression, state, n_max: int) -> float:
    """Median ms of prefill (+ eviction and compaction under compression)."""
    fn = lambda: (
        prepared_cache(model, prompt_BT, compression=compression, state=state, n_max=n_max).k
    )
    return median_ms(fn, repeats=1, calls=2)


def policy_ms(cache, compression: Compression, state, *, repeats: int) -> float:
    """Median ms of one eviction (scoring, selection, freeing) under ``compression``."""
    key = jax.random.key(1)
    fn = lambda: _evict(cache, state, key, compression=compression).pos  # noqa: E731
    return median_ms(fn, repeats=repeats)


def end_to_end(
    model: EvalModel, prompts: list[list[int]], *, new_tokens: int, repeats: int, **gen
) -> float:
    """Median seconds of one ``generate_tokens`` call (after a compiling warm-up)."""
    run = lambda: generate_ids(
        model, prompts, max_new_tokens=new_tokens, batch_size=len(prompts), **gen
    )
    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(
    model: EvalModel,
    groups: Sequence[PolicyGroup],
    *,
    ratios: Sequence[float],
    prompt_BT: np.ndarray,
    new_tokens: int,
    repeats: int,
    min_budget: int,
    store: report.ResultStore,
) -> list[dict]:
    """Times the full cache once and every evicting policy at every ratio."""
    B, T = prompt_BT.shape
    n_max = T + new_tokens
    prompts = [list(map(int, row)) for row in prompt_BT]
    members = [p for g in groups if not g.is_full for p in g.members]
    runs = [(g, m) for g in groups if not g.is_full for m in g.members]
    prompt = jnp.asarray(prompt_BT)
    params = model.params
    with report.progress(1 + len(ratios) * (1 + len(runs)), desc=NAME) as bar:
        cache = prepared_cache(model, prompt, compression=None, state=None, n_max=n_max)
        attn = step_ms(params, cache, config=model.config, repeats=repeats)
        total = end_to_end(model, prompts, new_tokens=new_tokens, repeats=repeats, compression=None)
        prefill = prefill_ms(model, prompt, compression=None, state=None, n_max=n_max)
        store.add(_row("full", 1.0, n_max, attn, None, None, total, prefill, B, new_tokens))
        bar.update()
        for ratio in ratios:
            # one cache (compressed once, by the first member) for the per-step timings
            comp = switch_compression(switch_policy(members), ratio=ratio, min_budget=min_budget)
            state0 = switch_state(members, 0)
            cache = prepared_cache(model, prompt, compression=comp, state=state0, n_max=n_max)
            attn = step_ms(params, cache, config=model.config, repeats=repeats)
            bar.update()
            for group, member in runs:
                alone = Compression(policy=member, ratio=ratio, min_budget=min_budget)
                state = member.init()
                pol = policy_ms(cache, alone, state, repeats=repeats)
                stat_ms = 0.0
                if member.stats:
                    with_stats = step_ms(
                        params, cache, config=model.config, repeats=repeats, stats=member.stats
                    )
                    stat_ms = max(with_stats - attn, 0.0)
                total = end_to_end(
                    model, prompts, new_tokens=new_tokens, repeats=repeats, compression=alone
                )
                prefill = prefill_ms(model, prompt, compression=alone, state=state, n_max=n_max)
                cap = alone.capacity(n_max)
                args = (attn, stat_ms, pol, total, prefill, B, new_tokens)
                store.add(_row(group.label, ratio, cap, *args))
                bar.update()
    return store.results()


def _row(policy, ratio, capacity, attn, feat, pol, total_s, prefill_ms, B, new_tokens) -> dict:
    decode_s = max(total_s - prefill_ms / 1000, 1e-9)
    return {
        "policy": policy,
        "ratio": ratio,
        "capacity": capacity,
        "attn_ms": attn,
        "feature_ms": feat,
        "policy_ms": pol,
        "prefill_ms": prefill_ms,
        "tokens_per_s": B * new_tokens / total_s,
        "decode_tokens_per_s": B * new_tokens / decode_s,
    }


def summarize(records: list[dict]) -> list[dict]:
    """Records are already one per (policy, ratio)."""
    return list(records)


def render(rows: list[dict]) -> str:
    """Markdown in the layout of the paper's Table 3."""
    header = ["policy", "r", "slots", "attn ms", "feature ms", "policy ms", "prefill ms"]
    header += ["tokens/s (e2e)", "decode tokens/s"]
    body = [
        [r["policy"], f"{r['ratio']:g}", r["capacity"], report.fmt(r["attn_ms"], 1)]
        + [report.fmt(r["feature_ms"], 2), report.fmt(r["policy_ms"], 2)]
        + [report.fmt(r["prefill_ms"], 0), report.fmt(r["tokens_per_s"], 2)]
        + [report.fmt(r["decode_tokens_per_s"], 2)]
        for r in rows
    ]
    return "Medians; ms per decode step.\n\n" + report.markdown_table(header, body)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Stacked per-step cost (attention / features / policy) per policy and ratio."""
    labels = [f"{r['policy']} r={r['ratio']:g}" for r in rows]
    bars = {
        "decode step (no stats)": [r["attn_ms"] for r in rows],
        "statistics/features": [r["feature_ms"] or 0.0 for r in rows],
        "policy + eviction": [r["policy_ms"] or 0.0 for r in rows],
    }
    return [
        report.bar_plot(
            labels,
            bars,
            out_dir / f"{NAME}.png",
            ylabel="ms per decode step",
            title="Per-step latency by component",
            stacked=True,
        )
    ]


def evaluate(job: Job, *, context: int, new_tokens: int, repeats: int) -> report.ResultStore:
    """Times ``job.batch_size`` prompts of ``context`` tokens of held-out tinyshakespeare with
    ``run``; returns the finished store (``job.limit`` and ``job.seeds`` are not used).

    Raises:
        ValueError: too little text for the prompts, before the model loads; a prompt and its
            new tokens longer than the model's context.
    """
    tasks.check_text_windows(window=context, n_windows=job.batch_size)
    model = runner.load_eval_model(job.model, dtype=job.dtype, attention=job.attention)
    runner.check_fits(model, context + new_tokens, what="--context + --new-tokens")
    prompt = tasks.text_windows(window=context, n_windows=job.batch_size, tokenizer=model.tokenizer)
    store = report.ResultStore(
        job.out,
        NAME,
        model=model.name,
        config={
            **job.config,
            "context": context,
            "new_tokens": new_tokens,
            "batch": job.batch_size,
            "repeats": repeats,
        },
        summarize=summarize,
        render=render,
        plot=plot,
        title="Decode latency by component and throughput (paper Table 3)",
    )
    run(
        model,
        job.groups,
        ratios=job.ratios,
        prompt_BT=prompt,
        new_tokens=new_tokens,
        repeats=repeats,
        min_budget=job.min_budget,
        store=store,
    )
    store.finish()
    return store
