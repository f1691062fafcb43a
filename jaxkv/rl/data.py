"""Token streams for training: windows of natural text and GSM8K train problems.

Shakespeare streams come from the first 90 % of tinyshakespeare (the evaluation holds out
the last 10 %); GSM8K streams from the train split (question, then the worked answer). The
window of step t depends only on (seed, t), so a resumed run sees the same data.
"""

from __future__ import annotations

import numpy as np

from jaxkv.data import default_data_dir, read_jsonl, read_text
from jaxkv.evals.tasks import split_heldout


def tokenize(tokenizer, text: str) -> np.ndarray:
    """Token ids of ``text``; bytes when there is no tokenizer (the tiny test model)."""
    if tokenizer is None:
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def build_corpora(tokenizer, *, dataset: str, data_dir=None, max_chars: int = 400_000) -> list:
    """Token arrays to draw windows from (one per source)."""
    data_dir = data_dir or default_data_dir()
    corpora = []
    if dataset in ("mixed", "shakespeare"):
        train, _ = split_heldout(read_text(data_dir / "tinyshakespeare" / "input.txt"))
        corpora.append(tokenize(tokenizer, train[:max_chars]))
    if dataset in ("mixed", "gsm8k"):
        parts, size = [], 0
        for _, rec in read_jsonl(data_dir / "gsm8k" / "train.jsonl"):
            parts.append(f"Question: {rec['question']}\nAnswer: {rec['answer']}\n\n")
            size += len(parts[-1])
            if size > max_chars:
                break
        corpora.append(tokenize(tokenizer, "".join(parts)))
    return corpora


def stream_for_step(corpora: list, *, step: int, seed: int, length: int) -> np.ndarray:
    """The training window of ``step``: deterministic in (seed, step)."""
    rng = np.random.default_rng([seed, step])
    corpus = corpora[step % len(corpora)]
    if corpus.size <= length:
        raise ValueError(f"corpus of {corpus.size} tokens is shorter than a {length}-token stream")
    start = int(rng.integers(0, corpus.size - length))
    return corpus[start : start + length]
