"""Token streams for training: windows of text from several domains.

Shakespeare streams come from the first 90 % of tinyshakespeare (the evaluation holds out
the last 10 %); GSM8K streams from the train split (question, then the worked answer). The
window of step t depends only on (seed, t), so a resumed run sees the same data.

Domains (``domain_text``), for training that holds one whole domain out:

* ``prose``: the first 90 % of tinyshakespeare;
* ``math``: GSM8K train problems with their worked answers, from the start of the file;
* ``code``: Python source of a fixed list of standard-library modules (the interpreter's own);
* ``chat``: GSM8K train problems from the end of the file, as chat-templated dialogue (system,
  user question, assistant answer) in the model's own chat template;
* ``recall`` (``RECALL_DOMAIN``, not in ``TRAIN_DOMAINS``: opt in with ``--domains``): token
  windows that quiz the model on facts stated earlier in math and code filler, each training
  point the end of a question (``jaxkv.rl.recall``); it has no ``domain_text``.
* ``reasoning`` (``HELDOUT_DOMAIN``): BIG-Bench Hard, each task's 3-shot chain-of-thought
  prompt followed by its questions and targets, cut into chunks of about ``CHUNK_CHARS`` at
  line ends and interleaved task by task, so that consecutive windows come from different
  tasks. No training or tuning reads it; it is the text
  the learned policies are evaluated on (``python -m jaxkv.eval fidelity --text`` on
  ``write_domain_text("reasoning", ...)``).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from jaxkv.data import default_data_dir, read_json, read_jsonl, read_text
from jaxkv.evals.tasks import bbh_fewshot_prefix, bbh_tasks, split_heldout

TRAIN_DOMAINS = ("prose", "math", "code", "chat")
RECALL_DOMAIN = "recall"  # token windows, not text: jaxkv.rl.recall
HELDOUT_DOMAIN = "reasoning"
DOMAINS = (*TRAIN_DOMAINS, RECALL_DOMAIN, HELDOUT_DOMAIN)
CODE_MODULES = (
    "argparse.py", "dataclasses.py", "functools.py", "json/decoder.py", "json/encoder.py",
    "pathlib.py", "textwrap.py", "heapq.py", "statistics.py", "fractions.py", "shutil.py",
    "inspect.py", "string.py", "csv.py", "tokenize.py", "difflib.py", "pprint.py", "enum.py",
)  # fmt: skip
CHUNK_CHARS = 3000
CHAT_SYSTEM = "You are a helpful assistant who solves math word problems step by step."


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


def domain_text(domain: str, *, tokenizer=None, data_dir=None, max_chars: int = 400_000) -> str:
    """About ``max_chars`` characters of one domain's text (see the module docstring).

    Raises:
        ValueError: unknown domain (naming the valid ones).
    """
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; choose from {DOMAINS}")
    if domain == RECALL_DOMAIN:
        raise ValueError("the recall domain is token windows (jaxkv.rl.recall), not text")
    data_dir = Path(data_dir or default_data_dir())
    if domain == "prose":
        train, _ = split_heldout(read_text(data_dir / "tinyshakespeare" / "input.txt"))
        return train[:max_chars]
    if domain == "code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return _take(
            (f"# {m}\n{read_text(stdlib / m)}\n" for m in CODE_MODULES if (stdlib / m).is_file()),
            max_chars,
        )
    if domain == "reasoning":
        return _take(_interleaved(_bbh_texts(data_dir)), max_chars)
    records = [rec for _, rec in read_jsonl(data_dir / "gsm8k" / "train.jsonl")]
    if domain == "math":
        parts = (f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in records)
        return _take(parts, max_chars)
    return _take((_chat(tokenizer, r) for r in reversed(records)), max_chars)


def write_domain_text(domain: str, path: str | Path, *, tokenizer=None, **kwargs) -> Path:
    """Writes ``domain_text`` to ``path`` (e.g. for ``python -m jaxkv.eval fidelity --text``)."""
    path = Path(path)
    path.write_text(domain_text(domain, tokenizer=tokenizer, **kwargs), encoding="utf-8")
    return path


def _take(parts, max_chars: int) -> str:
    out, size = [], 0
    for part in parts:
        out.append(part)
        size += len(part)
        if size >= max_chars:
            break
    return "".join(out)[:max_chars]


def _bbh_texts(data_dir: Path) -> list[str]:
    texts = []
    for task in bbh_tasks(data_dir=data_dir):
        rows = read_json(data_dir / "bbh" / "bbh" / f"{task}.json")["examples"]
        qa = "".join(f"Q: {row['input']}\nA: {row['target']}\n\n" for row in rows)
        texts.append(bbh_fewshot_prefix(task, data_dir=data_dir) + "\n\n" + qa)
    return texts


def _chunks(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of at most ``size`` characters, at line ends where possible."""
    out = []
    while text:
        cut = len(text) if len(text) <= size else text.rfind("\n", 0, size) + 1 or size
        out.append(text[:cut])
        text = text[cut:]
    return out


def _interleaved(texts: list[str]):
    """Chunks of every text in turn: chunk 0 of each, then chunk 1 of each, ..."""
    chunked = [_chunks(t, CHUNK_CHARS) for t in texts]
    for i in range(max(map(len, chunked))):
        yield from (c[i] for c in chunked if i < len(c))


def _chat(tokenizer, record: dict) -> str:
    turns = [
        {"role": "system", "content": CHAT_SYSTEM},
        {"role": "user", "content": record["question"]},
        {"role": "assistant", "content": record["answer"]},
    ]
    if tokenizer is None:
        return "".join(f"<|{t['role']}|>\n{t['content']}\n" for t in turns)
    return tokenizer.apply_chat_template(turns, tokenize=False)


def stream_for_step(corpora: list, *, step: int, seed: int, length: int) -> np.ndarray:
    """The training window of ``step``: deterministic in (seed, step)."""
    rng = np.random.default_rng([seed, step])
    corpus = corpora[step % len(corpora)]
    if corpus.size <= length:
        raise ValueError(f"corpus of {corpus.size} tokens is shorter than a {length}-token stream")
    start = int(rng.integers(0, corpus.size - length))
    return corpus[start : start + length]
