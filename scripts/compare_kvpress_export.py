"""jaxkv's side of scripts/compare_kvpress.sh, run in jaxkv's own .venv (no torch).

Writes ``OUT/windows.npz`` for the kvpress side (``compare_kvpress_run.py``):

* ``tokens``: [N, T] int32, the fidelity eval's held-out windows of the text
  (``jaxkv.evals.tasks.text_windows`` with the arguments ``python -m jaxkv.eval fidelity``
  gives it, so both sides and the jaxkv CLI runs see the same token ids);
* ``ref_logits``: [N, T - P, V] float32, jaxkv's full-cache teacher-forced logits
  (``jaxkv.evals.fidelity.stream_logits`` without compression): the kvpress side checks its
  own full-cache logits against them before anything else;
* ``kept/<policy>/<granularity>/<ratio>``: [N, L, K, P] bool, the prompt positions jaxkv
  keeps after the one compression of the ``prefill`` protocol (the ``--kept`` pairs), to
  compare with the positions each kvpress press keeps.

    .venv/bin/python scripts/compare_kvpress_export.py --out DIR [--text FILE] [--limit 8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import eviction, kvcache, policies
from jaxkv.evals import runner, tasks
from jaxkv.evals.fidelity import FidelitySettings, stream_logits
from jaxkv.model import decoder
from jaxkv.model.loading import embedded_model_path

# (jaxkv policy, granularity) pairs whose kept positions are exported by default: the ones
# that implement a kvpress press's method (see compare_kvpress_table.SAME_METHOD).
DEFAULT_KEPT = (
    "streaming_llm:shared,knorm:head,keydiff:head,tova:layer,snapkv:head,h2o:head,"
    "critical:snapkv:head,snapkv:adaptive"
)


def parse_kept(text: str) -> list[tuple[str, str]]:
    """``policy:granularity`` items (the policy may contain colons: ``critical:snapkv:head``)."""
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        policy, _, granularity = item.rpartition(":")
        if granularity not in eviction.GRANULARITIES or not policy:
            raise ValueError(f"--kept item {item!r} is not <policy>:<granularity>")
        pairs.append((policy, granularity))
    return pairs


def kept_masks(model, windows_NT, *, prompt_len, pairs, ratios, min_budget) -> dict:
    """{key: [N, L, K, P] bool} of the prompt positions kept by one prefill compression."""
    prompt = jnp.asarray(windows_NT[:, :prompt_len])
    stats = (*kvcache.STAT_NAMES, *kvcache.WEIGHT_STATS)  # every per-slot one (critical:)
    cache = kvcache.init_cache(
        model.config, batch_size=len(prompt), capacity=prompt_len, stats=stats
    )
    _, cache = jax.jit(decoder.prefill, static_argnames="config")(
        model.params, prompt, cache, config=model.config
    )
    out = {}
    for name, granularity in pairs:
        policy = policies.get_policy(name)
        for ratio in ratios:
            comp = eviction.Compression(
                policy=policy,
                ratio=ratio,
                min_budget=min_budget,
                granularity=granularity,
                protocol="prefill",
            )
            kept = eviction.evict(
                cache, comp, policy.init(), key=jax.random.key(0), max_drop=cache.capacity
            )
            pos_NLKC = np.moveaxis(np.asarray(kept.pos), 1, 0)
            mask = np.zeros(pos_NLKC.shape[:-1] + (prompt_len,), bool)
            n, l_, k, c = np.nonzero(pos_NLKC >= 0)
            mask[n, l_, k, pos_NLKC[n, l_, k, c]] = True
            out[f"kept/{name}/{granularity}/{ratio:g}"] = mask
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--text", default=None, help="text file (default: tinyshakespeare)")
    parser.add_argument("--heldout", type=float, default=tasks.HELDOUT_FRACTION)
    parser.add_argument("--offset", type=int, default=0, help="fidelity's --offset")
    parser.add_argument("--window", type=int, default=384)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--min-budget", type=int, default=32)
    parser.add_argument("--ratios", default="0.25,0.125")
    parser.add_argument("--kept", default=DEFAULT_KEPT, help="policy:granularity pairs")
    args = parser.parse_args()
    start = time.time()
    model = runner.load_eval_model("smollm2-135m")
    windows = tasks.text_windows(
        args.text,
        window=args.window,
        n_windows=args.limit,
        tokenizer=model.tokenizer,
        heldout_fraction=args.heldout,
        offset=args.offset,
    )
    settings = FidelitySettings(prompt_len=args.prompt_len, batch_size=args.batch)
    ref = stream_logits(model, windows, settings=settings, compression=None)
    ratios = [float(r) for r in args.ratios.split(",")]
    kept = kept_masks(
        model,
        windows,
        prompt_len=args.prompt_len,
        pairs=parse_kept(args.kept),
        ratios=ratios,
        min_budget=args.min_budget,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(
        args.out / "windows.npz",
        tokens=windows,
        ref_logits=ref.astype(np.float32),
        prompt_len=args.prompt_len,
        **kept,
    )
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta |= {
        "model": model.name,
        "gguf": str(embedded_model_path()),
        "n_windows": len(windows),
        "kept": sorted(kept),
    }
    (args.out / "windows.json").write_text(json.dumps(meta, indent=1) + "\n")
    took = time.time() - start
    print(f"export: {len(windows)} windows, {len(kept)} kept-position sets, {took:.0f} s")


if __name__ == "__main__":
    main()
