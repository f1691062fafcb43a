"""How peaked a ranker's scores are as Plackett-Luce logits, at several score scales.

For the per-head REINFORCE (``decisions: head``): prefills 97 tokens of 6 training windows
(``dataset: mixed``, seed 0, steps 1000-1005, which the seed-0 runs of 200 steps never read),
scores every (layer, KV head) row with the ranker, and prints the mean entropy of a drop-one
decision among each row's 25 highest-scoring slots (what a step after the first decides at
r = 0.25 with a 96-token prompt: keep 24 of 25) under ``scale`` × scores; a uniform choice has
log 25 = 3.22 nats. ``score_scale=32`` in results/rl_head_warmstart was read off this table.

    .venv/bin/python scripts/rl_score_scale.py [--ranker ranker_smollm2_cpu]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import kvcache
from jaxkv.model import decoder
from jaxkv.policies import ranker as ranker_lib
from jaxkv.policies.learned import checkpoint_path
from jaxkv.rl.data import build_corpora, stream_for_step
from jaxkv.rl.loop import load_lm

SCALES = (1, 2, 4, 8, 16, 32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranker", default="ranker_smollm2_cpu")
    args = p.parse_args()
    config, params, tokenizer = load_lm("smollm2-135m")
    corpora = build_corpora(tokenizer, dataset="mixed")
    weights, meta = ranker_lib.load_ranker_params(checkpoint_path(args.ranker))
    names = tuple(meta["features"])
    entropy = {s: [] for s in SCALES}
    for step in range(1000, 1006):
        window = stream_for_step(corpora, step=step, seed=0, length=128)
        cache = kvcache.init_cache(config, batch_size=1, capacity=128, stats=ranker_lib.STATS)
        _, cache = decoder.prefill(params, jnp.asarray(window[None, :97]), cache, config=config)
        scores = ranker_lib.head_scores(weights, cache, names=names)  # [L, 1, K, C]
        top = np.sort(np.asarray(scores).reshape(-1, 128)[:, :97], axis=1)[:, -25:]
        for s in SCALES:
            drop = np.asarray(jax.nn.softmax(-s * top, axis=1))  # P(drop i) ∝ exp(−s·score_i)
            entropy[s].append(float(-(drop * np.log(drop + 1e-30)).sum(1).mean()))
    print(f"uniform: {np.log(25):.3f} nats")
    for s in SCALES:
        print(f"scale {s:>2}: {np.mean(entropy[s]):.3f} nats")


if __name__ == "__main__":
    main()
