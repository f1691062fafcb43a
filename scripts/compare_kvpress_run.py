"""kvpress's side of scripts/compare_kvpress.sh, run in .venv-kvpress (torch, kvpress).

Reads the windows jaxkv exported (``compare_kvpress_export.py``: ``DIR/windows.npz`` and
``DIR/windows.json``), loads the same GGUF in transformers (float32, sdpa attention; eager
only for ObservedAttentionPress, which reads the attention weights), and for every window runs
the compress-once protocol that ``python -m jaxkv.eval fidelity --protocol prefill`` runs:

1. prefill the first P tokens inside ``with press(model)`` (the press compresses each layer's
   cache once, after that layer's attention: the prefill's own logits are full-cache, as in
   jaxkv, so the first continuation row has KL 0 on both sides);
2. teacher-force the remaining T - P - 1 tokens with no more compression, at their true
   positions (``position_ids`` P .. T-2 over a cache that holds fewer slots): one forward when
   every layer keeps as many slots, else one token at a time (PyramidKV's layer budgets);
3. KL(P_full || P_press) per continuation row, from log-softmax in float64 (as
   ``jaxkv.evals.metrics.kl_divergence``), mean over rows and windows (``kl_mean``), plus
   perplexity and top-1 agreement as ``jaxkv.evals.fidelity._scores`` defines them.

Before any press it checks that its full-cache logits equal jaxkv's (``ref_logits``) within
``--tol`` (max |Δlogit|), and stops with an error otherwise. It records which prompt positions
each press keeps per (layer, KV head): the compressed keys are exact copies of full-cache keys,
so they are matched back to their positions (head-masking presses, AdaKV and CriticalAdaKV, keep
every slot and mark the evicted ones in ``masked_key_indices``).

    .venv-kvpress/bin/python scripts/compare_kvpress_run.py --dir DIR [--presses a,b] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a press that wants a download fails at once
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading bar

import kvpress  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
from kvpress.presses import kvzip_press  # noqa: E402


def _snapkv():
    return kvpress.SnapKVPress()


def _expected():
    return kvpress.ExpectedAttentionPress()


# name -> factory of the press at kvpress's defaults; compression_ratio is set afterwards
# (every press here exposes it, wrappers forward it to their inner press). In the order they
# run: the presses jaxkv also implements first, PyramidKV (decoded token by token) last.
PRESSES = {
    "StreamingLLMPress": kvpress.StreamingLLMPress,
    "KnormPress": kvpress.KnormPress,
    "KeyDiffPress": kvpress.KeyDiffPress,
    "TOVAPress": kvpress.TOVAPress,
    "SnapKVPress": kvpress.SnapKVPress,
    "ObservedAttentionPress": kvpress.ObservedAttentionPress,
    "ExpectedAttentionPress": kvpress.ExpectedAttentionPress,
    "CriticalKVPress(SnapKVPress)": lambda: kvpress.CriticalKVPress(_snapkv()),
    "AdaKVPress(SnapKVPress)": lambda: kvpress.AdaKVPress(_snapkv()),
    "KVzipPress": kvpress.KVzipPress,
    "RandomPress": lambda: kvpress.RandomPress(seed=0),
    "AdaKVPress(ExpectedAttentionPress)": lambda: kvpress.AdaKVPress(_expected()),
    "CriticalAdaKVPress(SnapKVPress)": lambda: kvpress.CriticalAdaKVPress(_snapkv()),
    "LagKVPress": kvpress.LagKVPress,
    "CURPress": kvpress.CURPress,
    "LeverageScorePress": kvpress.LeverageScorePress,
    "NonCausalAttnPress": kvpress.NonCausalAttnPress,
    "CompactorPress": kvpress.CompactorPress,
    "CapPress": kvpress.CapPress,
    "KVComposePress": kvpress.KVComposePress,
    "ChunkKVPress(SnapKVPress)": lambda: kvpress.ChunkKVPress(_snapkv()),
    "BlockPress(SnapKVPress)": lambda: kvpress.BlockPress(_snapkv()),
    "PyramidKVPress": kvpress.PyramidKVPress,
}

# Presses left out by design, with the reason (they are listed in the table's notes).
NOT_RUN = {
    "QFilterPress": "downloads its Q-filters from the HF hub (nthngdy/<model>_qfilt)",
    "DuoAttentionPress": (
        "its budget is a share of streaming heads (head_compression_ratio), not a token "
        "ratio: compression_ratio cannot be set"
    ),
    "LUKVPress": "needs a precomputed LU-KV budget curve for the model (none for SmolLM2)",
    "FastKVzipPress": "downloads its trained gates from the HF hub (Jang-Hyun/Fast-KVzip)",
    "KVzapPress": "downloads its trained scorer model from the HF hub",
    "RestoreKVPress": "downloads restore embeddings from the HF hub",
    "ExpectedAttentionStatsPress": "downloads query statistics (or a dataset, kmfoda/booksum)",
    "DMSPress": "needs a model trained with dynamic memory sparsification",
    "ThinKPress": "prunes key channels, not tokens (no token budget to compare)",
    "SimLayerKVPress": "picks lazy layers by a threshold, not a compression ratio",
    "DecodingPress / CompressionRatioDecodingPress / PrefillDecodingPress / CAMPress": (
        "compress during decoding, not once after the prompt"
    ),
    "KeyRerotationPress / FinchPress": (
        "re-rotate kept keys to new positions (the continuation would start at another "
        "position than jaxkv's; FinchPress also needs a question delimiter)"
    ),
    "KVgradPress": "scores by gradients of a reconstruction loss (a backward pass per window)",
    "PerLayerCompressionPress / ComposedPress / ChunkPress / MergingPress / "
    "EntropyGatedChunkKVPress": (
        "wrappers without a method of their own at the defaults (per-layer ratios must be "
        "given; ChunkPress's 1024-token chunks exceed the 256-token prompt)"
    ),
}


def press_defaults(press) -> str:
    """The press's constructor fields other than compression_ratio, as ``k=v`` (nested)."""
    import dataclasses

    if not dataclasses.is_dataclass(press):
        return ""
    parts = []
    for f in dataclasses.fields(press):
        if not f.init or f.name.startswith("_") or f.name == "compression_ratio":
            continue
        v = getattr(press, f.name)
        if dataclasses.is_dataclass(v):
            inner = press_defaults(v)
            v = f"{type(v).__name__}({inner})"
        parts.append(f"{f.name}={v}")
    return ", ".join(parts)


def set_ratio(press, ratio: float) -> None:
    """kvpress compression_ratio = 1 - r (the share of the prompt's KV pairs dropped)."""
    press.compression_ratio = 1.0 - ratio


class Runner:
    """The GGUF model in transformers and the compress-once loop over one window."""

    def __init__(self, gguf: Path):
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name
        )
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        # KVzip builds its reconstruction prompt from AutoTokenizer.from_pretrained(name_or_path)
        # and, with a chat template, skips the template's prefix tokens of the context; the
        # windows are raw text, so it gets this tokenizer without a chat template (its
        # documented no-template path: no prefix, suffix "\n").
        plain = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        plain.chat_template = None
        kvzip_press.AutoTokenizer = type(
            "PlainTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: plain)}
        )

    @torch.no_grad()
    def stream(self, tokens_T: np.ndarray, prompt_len: int, press=None, full_keys=None):
        """(logits [T - P, V] float32, kept [L, K, P] bool) of one window under ``press``."""
        ids = torch.as_tensor(tokens_T[None].astype(np.int64))
        cache = transformers.DynamicCache()
        ctx = press(self.model) if press is not None else _null()
        eager = isinstance(press, kvpress.ObservedAttentionPress)
        if eager:
            self.model.set_attn_implementation("eager")
        try:
            with ctx:
                out = self.model(
                    input_ids=ids[:, :prompt_len], past_key_values=cache, logits_to_keep=1
                )
        finally:
            if eager:
                self.model.set_attn_implementation("sdpa")
        if full_keys is None:  # the full cache: remember its keys to identify kept positions
            self.last_keys = [layer.keys[0].clone() for layer in cache.layers]
            kept = None
        else:
            kept = self._kept(cache, prompt_len, full_keys)
        rest = ids[:, prompt_len:-1]
        pos = torch.arange(prompt_len, ids.shape[1] - 1)[None]
        lengths = {cache.layers[i].keys.shape[-2] for i in range(len(cache.layers))}
        if len(lengths) == 1:
            tail = self.model(input_ids=rest, past_key_values=cache, position_ids=pos).logits[0]
        else:
            tail = self._one_by_one(rest, pos, cache)
        logits = torch.cat([out.logits[0, -1:], tail]).float().numpy()
        return logits, kept

    def _one_by_one(self, rest, pos, cache):
        """Token-at-a-time decoding for caches whose layers hold different numbers of slots:
        a single query attends to every slot, and sdpa needs no mask for it."""
        outs = []
        for i in range(rest.shape[1]):
            outs.append(
                self.model(
                    input_ids=rest[:, i : i + 1],
                    past_key_values=cache,
                    position_ids=pos[:, i : i + 1],
                ).logits[0, -1]
            )
        return torch.stack(outs)

    def _kept(self, cache, prompt_len: int, full: list) -> np.ndarray:
        """[L, K, P] bool: the prompt positions each (layer, KV head) still holds."""
        rows = []
        for i, layer in enumerate(cache.layers):
            keys = layer.keys[0]  # [K, C, H]
            attn = self.model.model.layers[i].self_attn
            masked = getattr(attn, "masked_key_indices", None)
            if keys.shape[1] == prompt_len:
                kept = torch.ones(keys.shape[0], prompt_len, dtype=torch.bool)
                if masked is not None:
                    _, heads, seqs = masked
                    kept[heads, seqs] = False
            else:
                same = (keys[:, :, None, :] == full[i][:, None, :, :]).all(-1)  # [K, C, P]
                kept = same.any(1)
            rows.append(kept.numpy())
        return np.stack(rows)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def scores(ref_SV: np.ndarray, q_SV: np.ndarray, targets_S: np.ndarray) -> dict:
    """Per-window KL rows, NLL rows and top-1 agreement rows (jaxkv's fidelity metrics)."""
    logp, logq = log_softmax(ref_SV), log_softmax(q_SV)
    kl = np.maximum(np.sum(np.exp(logp) * (logp - logq), -1), 0.0)
    nll = -np.take_along_axis(logq, targets_S[:, None], -1)[:, 0]
    agree = np.argmax(ref_SV, -1) == np.argmax(q_SV, -1)
    return {"kl": kl, "nll": nll, "agree": agree}


def summarize(per_window: list[dict]) -> dict:
    kl = np.stack([w["kl"] for w in per_window])
    nll = np.stack([w["nll"] for w in per_window])
    agree = np.stack([w["agree"] for w in per_window])
    return {
        "kl_mean": float(kl.mean()),
        "kl_per_window": [float(x) for x in kl.mean(1)],
        "ppl": float(math.exp(nll.mean())),
        "top1_agreement": float(agree.mean()),
    }


def write(path: Path, rows, failures, *, n, prompt_len, worst, tol, start, kept_out) -> dict:
    """kvpress.json (rewritten after every press, so a stopped run keeps what it finished)."""
    out = {
        "kvpress_version": _version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "windows": n,
        "prompt_len": prompt_len,
        "max_abs_dlogit_vs_jaxkv": worst,
        "tol": tol,
        "rows": rows,
        "failed": failures,
        "not_run": NOT_RUN,
        "seconds": time.time() - start,
    }
    (path / "kvpress.json").write_text(json.dumps(out, indent=1) + "\n")
    np.savez_compressed(path / "kvpress_kept.npz", **kept_out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="the export folder")
    parser.add_argument("--presses", default=",".join(PRESSES), help="comma list of PRESSES names")
    parser.add_argument("--ratios", default="0.25,0.125", help="kept fractions r")
    parser.add_argument("--limit", type=int, default=None, help="first N windows only")
    parser.add_argument("--tol", type=float, default=1e-3, help="max |Δlogit| full vs jaxkv")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    meta = json.loads((args.dir / "windows.json").read_text())
    data = np.load(args.dir / "windows.npz")
    tokens, ref_jaxkv = data["tokens"], data["ref_logits"]
    n = len(tokens) if args.limit is None else min(args.limit, len(tokens))
    prompt_len = int(data["prompt_len"])
    names = [s.strip() for s in args.presses.split(",") if s.strip()]
    unknown = [s for s in names if s not in PRESSES]
    if unknown:
        sys.exit(f"unknown press(es) {unknown}; choose from {list(PRESSES)}")
    ratios = [float(r) for r in args.ratios.split(",")]
    start = time.time()
    runner = Runner(Path(meta["gguf"]))

    full, keys = [], []
    worst = 0.0
    for w in range(n):
        logits, _ = runner.stream(tokens[w], prompt_len)
        full.append(logits)
        keys.append(runner.last_keys)
        worst = max(worst, float(np.abs(logits - ref_jaxkv[w]).max()))
    print(
        f"full-cache logits, kvpress side vs jaxkv: max |Δlogit| = {worst:.2e} "
        f"over {n} windows x {full[0].shape[0]} rows (tolerance {args.tol:g})",
        flush=True,
    )
    if not worst <= args.tol:
        sys.exit(
            f"FAIL: full-cache logits differ by {worst:.3e} > {args.tol:g}; the two sides "
            "do not run the same model on the same tokens, so no comparison is made"
        )
    # The KL reference of the kvpress rows is kvpress's own full cache, as jaxkv's rows use
    # jaxkv's; the check above bounds how far the two references are apart.
    full_stats = summarize(
        [scores(f, f, t[prompt_len:]) for f, t in zip(full, tokens[:n], strict=True)]
    )

    rows, failures = [], {}
    kept_out = {}

    def flush() -> dict:  # the tables so far: an interrupted run keeps its finished rows
        return write(
            args.dir, rows, failures, n=n, prompt_len=prompt_len, worst=worst, tol=args.tol,
            start=start, kept_out=kept_out,
        )  # fmt: skip

    for name in names:
        for ratio in ratios:
            t0 = time.time()
            try:
                per_window = []
                for w in range(n):
                    press = PRESSES[name]()
                    set_ratio(press, ratio)
                    logits, kept = runner.stream(tokens[w], prompt_len, press, keys[w])
                    per_window.append(scores(full[w], logits, tokens[w][prompt_len:]))
                    kept_out[f"kept/{name}/{ratio:g}/{w}"] = kept
            except Exception as e:  # a press that cannot run here is reported, not fatal
                failures[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                traceback.print_exc(limit=2)
                print(f"{name}: FAILED ({failures[name]})", flush=True)
                break
            row = {
                "side": "kvpress",
                "method": name,
                "granularity": "press",
                "ratio": ratio,
                "compression_ratio": 1.0 - ratio,
                "defaults": press_defaults(PRESSES[name]()),
                "ppl_full": full_stats["ppl"],
                "seconds": time.time() - t0,
                **summarize(per_window),
            }
            rows.append(row)
            flush()
            print(
                f"{name:38s} r={ratio:<6g} KL {row['kl_mean']:.4f}  ({row['seconds']:.0f} s)",
                flush=True,
            )
    out = flush()
    print(f"kvpress: {len(rows)} rows, {len(failures)} failed, {out['seconds']:.0f} s")


def _version() -> str:
    from importlib.metadata import version

    return version("kvpress")


if __name__ == "__main__":
    main()
