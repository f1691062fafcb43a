"""Evaluation tasks as lists of ``Example(id, prompt, target, meta)``: prompts only, no model code.

Every prompt is completion style (no chat template) unless ``meta["chat_template"]`` says
otherwise. ``meta`` always carries ``task``, ``max_new_tokens`` and ``stop`` (strings after which
the generation may be cut; the scoring functions in ``jaxkv.evals.metrics`` cut there too).

* ``gsm8k_examples``: 8-shot chain of thought, lm-evaluation-harness ``gsm8k-cot`` format
  (``Q: ...\\nA: ...`` exemplars joined by blank lines); target = the final number
  (score with ``metrics.gsm8k_extract``).
* ``bbh_examples``: the task's 3-shot CoT prompt + ``Q: {input}\\nA: Let's think step by step.``;
  target = the BBH target (score with ``metrics.bbh_match``).
* ``longbench_examples``: LongBench-format JSONL from a path, formatted with the official
  ``dataset2prompt`` templates; target = all answers (score with ``metrics.longbench_score``).
* ``passkey_examples`` / ``needle_examples``: seeded synthetic retrieval prompts of about
  ``n_tokens`` tokens; target = the key (score with ``metrics.retrieval_match``).
* ``text_windows``: token windows of a held-out text part for the teacher-forced fidelity run.

Filler (measured with the embedded SmolLM2-135M-Instruct, full cache, greedy, 6 seeded prompts):

* ``passkey_examples`` uses the classic repeated "The grass is green..." filler
  (``GRASS_FILLER``) of the standard passkey task (Mohtashami & Jaggi, 2023): 6/6 at 1K and 2K
  tokens, 5/6 at 4K. With tinyshakespeare filler the model scored only 3/6 at 1K and 2/6 at 2K:
  after prose it continues "The pass key is" as prose ("a key that is passed ...").
* ``needle_examples`` uses tinyshakespeare (natural text, like Kamradt's essay haystack) with a
  RULER-style "special magic number for {word}" needle: 6/6 at 1K, 2K and 4K. Natural filler
  matters for eviction: repeated filler is trivially compressible, so a policy can keep the
  needle just because it is the only novel span.

Both take ``filler=`` to swap (any text; it is cycled as needed).

Held-out text: ``text_windows`` reads the last ``HELDOUT_FRACTION`` (10 %) of the file, from the
first line start at or after 90 % of its characters; ``split_heldout`` gives both parts so that
training code can use the first 90 % only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxkv import data as data_lib
from jaxkv.evals import metrics

PathLike = str | os.PathLike

HELDOUT_FRACTION = 0.1
GSM8K_MAX_NEW_TOKENS = 512
BBH_MAX_NEW_TOKENS = 512
RETRIEVAL_MAX_NEW_TOKENS = 20

GRASS_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
NEEDLE_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards.\n\n"
)
NEEDLE_TEXT = "One of the special magic numbers for {word} is: {key}."
NEEDLE_QUESTION = (
    "\nWhat is the special magic number for {word} mentioned in the text above? "
    "The special magic number for {word} mentioned in the text above is"
)
NEEDLE_WORDS = tuple(
    "apple harbor violin meadow lantern falcon granite orchid compass thunder velvet glacier "
    "saffron marble pepper canyon willow ember quartz maple anchor cobalt juniper tundra sparrow "
    "obsidian lagoon cedar beacon fjord".split()
)

_LONGBENCH_FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")
_LONGBENCH_NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
_LONGBENCH_NEWLINE_EOS = ("samsum",)


@dataclasses.dataclass(frozen=True)
class Example:
    """One evaluation example.

    Attributes:
        id: unique within its task (e.g. ``"gsm8k-test-17"``, a LongBench ``_id``).
        prompt: the full prompt text.
        target: the reference answer; a tuple of accepted answers for LongBench.
        meta: task-specific facts (``task``, ``max_new_tokens``, ``stop``, ...).
    """

    id: str
    prompt: str
    target: str | tuple[str, ...]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Tokenizer adapters


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens.

    ``tokenizer`` is a transformers tokenizer (anything with ``encode``) or a callable
    ``text -> sequence of ids``.
    """
    if hasattr(tokenizer, "encode"):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    return list(tokenizer(text))


def token_count(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text``.

    ``tokenizer`` is as in ``token_ids``, or a callable returning the count itself (an int) or any
    sequence of tokens (``str.split`` works as a whitespace tokenizer).
    """
    if hasattr(tokenizer, "encode"):
        return len(token_ids(tokenizer, text))
    out = tokenizer(text)
    return out if isinstance(out, int) else len(out)


def _limit(items: list, limit: int | None) -> list:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return items if limit is None else items[:limit]


# ----------------------------------------------------------------------------------------------
# GSM8K


def gsm8k_fewshot_prefix(*, n_shot: int = 8, data_dir: PathLike | None = None) -> str:
    """The lm-evaluation-harness ``gsm8k-cot`` few-shot block, ending in a blank line.

    Each exemplar is ``"Q: {question}\\nA: {chain of thought} The answer is N."``; exemplars are
    joined by a blank line (the harness's ``fewshot_delimiter``).

    Raises:
        ValueError: ``n_shot`` outside 0..(number of exemplars).
    """
    path = (
        data_lib.resolve_data_dir(data_dir) / "gsm8k/lm_eval_harness/gsm8k_cot_8shot_exemplars.json"
    )
    spec = data_lib.read_json(path)
    exemplars = spec["exemplars"]
    if not 0 <= n_shot <= len(exemplars):
        raise ValueError(f"n_shot must be in 0..{len(exemplars)}, got {n_shot}")
    shots = [f"Q: {e['question']}\nA: {e['target']}" for e in exemplars[:n_shot]]
    return "".join(shot + "\n\n" for shot in shots)


def gsm8k_examples(
    split: str = "test",
    *,
    n_shot: int = 8,
    limit: int | None = None,
    data_dir: PathLike | None = None,
) -> list[Example]:
    """GSM8K chain-of-thought examples (paper: 8-shot CoT, exact match on the final number).

    Args:
        split: ``"test"`` (1,319) or ``"train"`` (7,473).
        n_shot: exemplars to prepend (the 8 standard ones of Wei et al., in order).
        limit: keep only the first ``limit`` examples.
        data_dir: the shared data folder (default: ``data.default_data_dir()``).

    Returns:
        Examples whose prompt ends ``"Q: {question}\\nA:"`` and whose target is the canonical
        final number (compare with ``metrics.gsm8k_extract(completion)``).

    Raises:
        ValueError: unknown split, bad ``n_shot``, or a malformed line / record.
        FileNotFoundError: missing data file.
    """
    if split not in ("test", "train"):
        raise ValueError(f"unknown GSM8K split {split!r}; valid: 'test', 'train'")
    root = data_lib.resolve_data_dir(data_dir)
    prefix = gsm8k_fewshot_prefix(n_shot=n_shot, data_dir=root)
    path = root / "gsm8k" / f"{split}.jsonl"
    examples = []
    for lineno, record in data_lib.read_jsonl(path):
        _require_fields(record, ("question", "answer"), path=path, lineno=lineno)
        examples.append(gsm8k_example(record, prefix=prefix, split=split, index=len(examples)))
        if limit is not None and len(examples) >= limit:
            break
    return _limit(examples, limit)


def gsm8k_example(record: dict, *, prefix: str, split: str, index: int) -> Example:
    """One GSM8K example from a ``{question, answer}`` record (the answer ends ``#### N``).

    Args:
        record: the GSM8K row.
        prefix: the few-shot block (``gsm8k_fewshot_prefix``).
        split: the split, named in the id.
        index: the row's 0-based position in the split, named in the id.
    """
    return Example(
        id=f"gsm8k-{split}-{index}",
        prompt=f"{prefix}Q: {record['question']}\nA:",
        target=metrics.gsm8k_target(record["answer"]),
        meta={
            "task": "gsm8k",
            "question": record["question"],
            "max_new_tokens": GSM8K_MAX_NEW_TOKENS,
            "stop": metrics.GSM8K_STOP,
        },
    )


# ----------------------------------------------------------------------------------------------
# BIG-Bench Hard


def bbh_tasks(*, data_dir: PathLike | None = None) -> list[str]:
    """Names of the BBH tasks present in the data folder (sorted).

    Raises:
        FileNotFoundError: the folder ``bbh/bbh`` is missing.
    """
    folder = data_lib.resolve_data_dir(data_dir) / "bbh" / "bbh"
    if not folder.is_dir():
        raise FileNotFoundError(f"BBH data folder not found: {folder}")
    return sorted(p.stem for p in folder.glob("*.json"))


def bbh_fewshot_prefix(task: str, *, data_dir: PathLike | None = None) -> str:
    """The task's 3-shot chain-of-thought prompt, without its canary and ``-----`` lines."""
    path = data_lib.resolve_data_dir(data_dir) / "bbh" / "cot-prompts" / f"{task}.txt"
    lines = data_lib.read_text(path).split("\n")
    return "\n".join(lines[2:]).strip()


def bbh_examples(
    task: str, *, limit: int | None = None, data_dir: PathLike | None = None
) -> list[Example]:
    """BIG-Bench Hard examples with the standard 3-shot chain-of-thought prompt.

    The prompt is ``{cot prompt}\\n\\nQ: {input}\\nA: Let's think step by step.``, as in
    Suzgun et al.

    Args:
        task: a BBH task name, e.g. ``"date_understanding"``.
        limit: keep only the first ``limit`` examples.
        data_dir: the shared data folder.

    Returns:
        Examples with the BBH target (``"(B)"``, ``"False"``, ``"24"``, ...).

    Raises:
        ValueError: unknown task (the message lists the valid ones) or a malformed file.
        FileNotFoundError: missing data files.
    """
    valid = bbh_tasks(data_dir=data_dir)
    if task not in valid:
        raise ValueError(f"unknown BBH task {task!r}; valid tasks: {', '.join(valid)}")
    root = data_lib.resolve_data_dir(data_dir)
    prefix = bbh_fewshot_prefix(task, data_dir=root)
    path = root / "bbh" / "bbh" / f"{task}.json"
    spec = data_lib.read_json(path)
    rows = spec.get("examples") if isinstance(spec, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list under 'examples'")
    examples = []
    for i, row in enumerate(_limit(rows, limit)):
        _require_fields(row, ("input", "target"), path=path, lineno=None, index=i)
        examples.append(bbh_example(row, prefix=prefix, task=task, index=i))
    return examples


def bbh_example(row: dict, *, prefix: str, task: str, index: int) -> Example:
    """One BBH example from an ``{input, target}`` row.

    Args:
        row: the BBH row.
        prefix: the task's chain-of-thought prompt (``bbh_fewshot_prefix``).
        task: the BBH task name.
        index: the row's 0-based position in the task, named in the id.
    """
    return Example(
        id=f"bbh/{task}-{index}",
        prompt=f"{prefix}\n\nQ: {row['input']}\nA: Let's think step by step.",
        target=str(row["target"]),
        meta={
            "task": f"bbh/{task}",
            "max_new_tokens": BBH_MAX_NEW_TOKENS,
            "stop": metrics.BBH_STOP,
        },
    )


# ----------------------------------------------------------------------------------------------
# LongBench


@dataclasses.dataclass(frozen=True)
class LongBenchConfig:
    """The official LongBench prompt templates, generation lengths and metric names."""

    prompts: dict[str, str]
    max_new_tokens: dict[str, int]
    metric: dict[str, str]
    first_line_only: tuple[str, ...] = _LONGBENCH_FIRST_LINE
    no_chat_template: tuple[str, ...] = _LONGBENCH_NO_CHAT
    newline_eos: tuple[str, ...] = _LONGBENCH_NEWLINE_EOS


def load_longbench_config(config_dir: PathLike | None = None) -> LongBenchConfig:
    """Reads ``dataset2prompt.json``, ``dataset2maxlen.json`` and ``dataset2metric.json``.

    ``dataset2metric.json`` may be the flat name -> metric map or the shared copy's object with
    ``dataset2metric`` and the dataset lists of LongBench's ``eval.py`` / ``pred.py``.
    """
    root = Path(config_dir) if config_dir is not None else _default_longbench_dir()
    metric_spec = data_lib.read_json(root / "dataset2metric.json")
    nested = "dataset2metric" in metric_spec
    return LongBenchConfig(
        prompts=data_lib.read_json(root / "dataset2prompt.json"),
        max_new_tokens=data_lib.read_json(root / "dataset2maxlen.json"),
        metric=metric_spec["dataset2metric"] if nested else metric_spec,
        first_line_only=tuple(metric_spec.get("first_line_only_datasets", _LONGBENCH_FIRST_LINE)),
        no_chat_template=tuple(metric_spec.get("no_chat_template_datasets", _LONGBENCH_NO_CHAT)),
        newline_eos=tuple(metric_spec.get("newline_eos_datasets", _LONGBENCH_NEWLINE_EOS)),
    )


def _default_longbench_dir() -> Path:
    return data_lib.default_data_dir() / "longbench" / "config"


def longbench_dataset_name(path: PathLike) -> str:
    """The dataset a LongBench file is named after: ``hotpotqa_e.jsonl`` -> ``hotpotqa``."""
    stem = Path(path).stem
    return stem[: -len("_e")] if stem.endswith("_e") else stem


def iter_longbench_examples(
    path: PathLike, *, dataset: str | None = None, config_dir: PathLike | None = None
) -> Iterator[Example]:
    """Lazily yields LongBench examples from a LongBench-format JSONL file.

    Same arguments and errors as ``longbench_examples``; errors surface when the bad line is
    reached, after the examples before it have been yielded. A file without any record raises
    once it has been read to its end.
    """
    data_lib.require_file(path)  # a missing file first: its name may not be a dataset's
    config = load_longbench_config(config_dir)
    dataset = dataset or longbench_dataset_name(path)
    check_longbench_dataset(dataset, config)
    n_records = 0
    for lineno, record in _jsonl_records(path):
        n_records += 1
        yield longbench_example(record, config=config, dataset=dataset, path=path, lineno=lineno)
    if not n_records:
        raise ValueError(f"{path}: no records (the file is empty); a LongBench file needs some")


def longbench_example(
    record: dict, *, config: LongBenchConfig, dataset: str, path: PathLike, lineno: int
) -> Example:
    """One LongBench example from a record, checked, with the official template.

    Args:
        record: the LongBench row (``input``, ``context``, ``answers``; ``all_classes`` for the
            classification datasets; ``_id`` and ``length`` are used when present).
        config: the templates and metrics (``load_longbench_config``).
        dataset: a dataset that ``check_longbench_dataset`` accepts.
        path: where the record comes from, for errors.
        lineno: its 1-based line, for errors, ``meta["line"]`` and the id of a row without ``_id``.

    Raises:
        ValueError: a missing field or one of the wrong type, naming ``path`` and ``lineno``.
    """
    metric = config.metric[dataset]
    fields = ("input", "context", "answers")
    if metric == "classification_score":
        fields += ("all_classes",)
    _require_fields(record, fields, path=path, lineno=lineno)
    _check_longbench_types(record, path=path, lineno=lineno)
    return Example(
        id=str(record.get("_id") or f"{dataset}-{lineno}"),
        prompt=config.prompts[dataset].format(context=record["context"], input=record["input"]),
        target=tuple(record["answers"]),
        meta={
            "task": f"longbench/{dataset}",
            "dataset": dataset,
            "metric": metric,
            "max_new_tokens": int(config.max_new_tokens[dataset]),
            "stop": ("\n",) if dataset in config.newline_eos else (),
            "all_classes": tuple(record.get("all_classes") or ()),
            "length": record.get("length"),
            "first_line_only": dataset in config.first_line_only,
            "chat_template": dataset not in config.no_chat_template,
            "line": lineno,
        },
    )


def _jsonl_records(path: PathLike) -> Iterator[tuple[int, dict]]:
    """``data.read_jsonl`` with a one-line error for a file that is not UTF-8 text."""
    records = data_lib.read_jsonl(path)
    while True:
        try:
            item = next(records)
        except StopIteration:
            return
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text") from None
        yield item


def _is_str_list(value: Any, *, non_empty: bool) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(v, str) for v in value)
        and (bool(value) or not non_empty)
    )


def _check_longbench_types(record: dict, *, path: PathLike, lineno: int) -> None:
    """``file:line: field X must be ...`` for a field of the wrong type (absent ones pass)."""
    checks = (
        ("input", lambda v: isinstance(v, str), "a string"),
        ("context", lambda v: isinstance(v, str), "a string"),
        ("answers", lambda v: _is_str_list(v, non_empty=True), "a non-empty list of strings"),
        ("all_classes", lambda v: _is_str_list(v, non_empty=False), "a list of strings or null"),
        ("length", lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        ("_id", lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a string"),
    )
    for field, ok, want in checks:
        value = record.get(field)
        if value is not None and not ok(value):
            got = json.dumps(value)
            got = got if len(got) <= 40 else got[:37] + "..."
            raise ValueError(f"{path}:{lineno}: field {field!r} must be {want}, got {got}")


def longbench_examples(
    path: PathLike,
    *,
    dataset: str | None = None,
    limit: int | None = None,
    config_dir: PathLike | None = None,
) -> list[Example]:
    """LongBench examples from a LongBench-format JSONL file (one JSON object per line).

    Each line needs ``input``, ``context`` and ``answers`` (and ``all_classes`` for the
    classification datasets); ``_id`` and ``length`` are used when present. The prompt is the
    official ``dataset2prompt`` template; ``meta`` carries ``metric``, ``max_new_tokens``,
    ``all_classes``, ``first_line_only`` and ``chat_template`` (False for the datasets LongBench
    runs without one). Long prompts are not truncated here: see ``truncate_middle``.

    Args:
        path: the JSONL file.
        dataset: the LongBench dataset name (default: from the file name, ``_e`` removed).
        limit: keep only the first ``limit`` examples (later lines are not read).
        config_dir: the folder with the three config JSON files (default: the shared data's
            ``longbench/config``).

    Returns:
        The examples, target = the tuple of accepted answers.

    Raises:
        FileNotFoundError: missing file.
        ValueError: unknown or unsupported (Chinese) dataset, a file that is not UTF-8 text or
            holds no record, a malformed JSON line, a line without a required field or with a
            field of the wrong type (``answers`` a non-empty list of strings, ``input`` and
            ``context`` strings, ``length`` an integer, ...) — with the file and line number.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    examples = []
    for example in iter_longbench_examples(path, dataset=dataset, config_dir=config_dir):
        if limit is not None and len(examples) >= limit:
            break
        examples.append(example)
    return examples


def check_longbench_dataset(dataset: str, config: LongBenchConfig) -> None:
    """Raises ValueError for a dataset without a template or with an unsupported metric."""
    if dataset not in config.prompts or dataset not in config.metric:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; valid: {sorted(config.prompts)}")
    if config.metric[dataset] not in metrics.LONGBENCH_METRICS:
        raise ValueError(
            f"LongBench dataset {dataset!r} uses {config.metric[dataset]!r}, which needs a Chinese "
            f"word segmenter (jieba) and is not supported; supported metrics: "
            f"{sorted(metrics.LONGBENCH_METRICS)}"
        )


def truncate_middle(ids: Sequence[int], max_len: int) -> list[int]:
    """LongBench's truncation: over ``max_len`` tokens, keep the first and last ``max_len // 2``."""
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    half = max_len // 2
    return ids[:half] + ids[len(ids) - half :]


def _require_fields(
    record: dict, fields: Sequence[str], *, path: PathLike, lineno: int | None, index: int = 0
) -> None:
    missing = [f for f in fields if f not in record or record[f] is None]
    if missing:
        where = f"{path}:{lineno}" if lineno is not None else f"{path} (example {index})"
        raise ValueError(f"{where}: missing required field(s) {missing}")


# ----------------------------------------------------------------------------------------------
# Synthetic retrieval: passkey and needle in a haystack


def filler_units(text: str) -> list[str]:
    """Filler text cut into units a needle can sit between: lines, or sentences for one-line text.

    Each unit keeps its separator (``"\\n"`` or ``" "``), so concatenating units gives text.

    Raises:
        ValueError: the text has no non-blank unit.
    """
    if "\n" in text.strip():
        units = [line.strip() + "\n" for line in text.splitlines() if line.strip()]
    else:
        units = [s + " " for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    if not units:
        raise ValueError("filler text is empty")
    return units


def _shakespeare_unless(filler: str | None, data_dir: PathLike | None) -> str:
    if filler is not None:
        return filler
    return data_lib.read_text(data_lib.resolve_data_dir(data_dir) / "tinyshakespeare" / "input.txt")


def _take_filler(
    units: list[str], *, start: int, budget: int, count: Callable[[str], int]
) -> list[str]:
    """The most consecutive units (cyclic from ``start``) whose text fits in ``budget`` tokens."""
    take = lambda k: [units[(start + i) % len(units)] for i in range(k)]
    hi = 1
    while count("".join(take(hi))) <= budget:
        hi *= 2
    lo = hi // 2  # take(lo) fits (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count("".join(take(mid))) <= budget else (lo, mid)
    return take(lo)


def _haystack(
    needles: Sequence[str],
    *,
    intro: str,
    question: str,
    n_tokens: int,
    units: list[str],
    rng: np.random.Generator,
    count: Callable[[str], int],
) -> tuple[str, list[float]]:
    """Intro + filler with ``needles`` at seeded depths + question, about ``n_tokens`` long."""
    sep = "\n" if units[0].endswith("\n") else " "
    needle_units = [n + sep for n in needles]
    budget = n_tokens - count(intro + "".join(needle_units) + question)
    if budget <= 0:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for filler around the question")
    body = _take_filler(units, start=int(rng.integers(len(units))), budget=budget, count=count)
    depths = [float(d) for d in rng.uniform(0.0, 1.0, size=len(needles))]
    # insert deepest first so that earlier insertions do not shift later indices
    for depth, needle in sorted(zip(depths, needle_units, strict=True), reverse=True):
        body.insert(round(depth * len(body)), needle)
    return intro + "".join(body).rstrip() + "\n" + question, depths


def passkey_examples(
    *,
    n_tokens: int,
    n: int,
    seed: int,
    tokenizer: Any,
    filler: str | None = None,
) -> list[Example]:
    """Seeded passkey-retrieval prompts of about ``n_tokens`` tokens (completion style).

    ``"{intro}{filler ... The pass key is 71432. Remember it. ... filler}\\nWhat is the pass key?
    The pass key is"``; the key is a 5-digit number stated once, at a seeded uniform depth.

    Args:
        n_tokens: the requested prompt length, measured with ``tokenizer``.
        n: number of examples.
        seed: the seed of keys, depths and filler offsets.
        tokenizer: a transformers tokenizer or a callable (see ``token_count``).
        filler: filler text, cycled as needed (default: ``GRASS_FILLER``, the classic task).

    Returns:
        Examples with target = the key; ``meta`` has ``depth`` (0 = start, 1 = end) and
        ``n_tokens`` (the measured length).
    """
    units = filler_units(GRASS_FILLER if filler is None else filler)
    count = lambda text: token_count(tokenizer, text)
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        key = _fresh_key(rng, digits=5, units=units)
        prompt, (depth,) = _haystack(
            [PASSKEY_NEEDLE.format(key=key)],
            intro=PASSKEY_INTRO,
            question=PASSKEY_QUESTION,
            n_tokens=n_tokens,
            units=units,
            rng=rng,
            count=count,
        )
        examples.append(_retrieval_example("passkey", i, prompt, key, depth, n_tokens, count))
    return examples


def needle_examples(
    *,
    n_tokens: int,
    n: int,
    seed: int,
    tokenizer: Any,
    n_distractors: int = 0,
    filler: str | None = None,
    data_dir: PathLike | None = None,
) -> list[Example]:
    """Seeded needle-in-a-haystack prompts (RULER-style key -> 7-digit value), completion style.

    The needle ``"One of the special magic numbers for {word} is: {number}."`` sits at a seeded
    depth; ``n_distractors`` more needles with other words and numbers can be added at their own
    depths. The prompt ends ``"The special magic number for {word} mentioned in the text above
    is"``.

    Args:
        n_tokens: the requested prompt length, measured with ``tokenizer``.
        n: number of examples.
        seed: the seed of words, numbers, depths and filler offsets.
        tokenizer: a transformers tokenizer or a callable (see ``token_count``).
        n_distractors: extra needles with other keys (0 = single-needle retrieval).
        filler: filler text, cycled as needed (default: tinyshakespeare).
        data_dir: the shared data folder (for the default filler).

    Returns:
        Examples with target = the asked-for number; ``meta`` has ``depth``, ``word``,
        ``n_tokens``.
    """
    if not 0 <= n_distractors < len(NEEDLE_WORDS):
        raise ValueError(f"n_distractors must be in 0..{len(NEEDLE_WORDS) - 1}")
    units = filler_units(_shakespeare_unless(filler, data_dir))
    count = lambda text: token_count(tokenizer, text)
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        words = [str(w) for w in rng.choice(NEEDLE_WORDS, size=1 + n_distractors, replace=False)]
        keys = [_fresh_key(rng, digits=7, units=units) for _ in words]
        prompt, depths = _haystack(
            [NEEDLE_TEXT.format(word=w, key=k) for w, k in zip(words, keys, strict=True)],
            intro=NEEDLE_INTRO,
            question=NEEDLE_QUESTION.format(word=words[0]),
            n_tokens=n_tokens,
            units=units,
            rng=rng,
            count=count,
        )
        examples.append(
            _retrieval_example(
                "needle", i, prompt, keys[0], depths[0], n_tokens, count, word=words[0]
            )
        )
    return examples


def _fresh_key(rng: np.random.Generator, *, digits: int, units: list[str]) -> str:
    """A random ``digits``-digit number that does not occur in the first filler units."""
    sample = "".join(units[:2000])
    while True:
        key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
        if key not in sample:
            return key


def _retrieval_example(
    task: str, i: int, prompt: str, key: str, depth: float, n_tokens: int, count, **extra: Any
) -> Example:
    return Example(
        id=f"{task}-{n_tokens}-{i}",
        prompt=prompt,
        target=key,
        meta={
            "task": task,
            "depth": depth,
            "requested_tokens": n_tokens,
            "n_tokens": count(prompt),
            "max_new_tokens": RETRIEVAL_MAX_NEW_TOKENS,
            "stop": ("\n",),
            **extra,
        },
    )


# ----------------------------------------------------------------------------------------------
# Held-out text windows (fidelity evaluation)


def split_heldout(text: str, *, fraction: float = HELDOUT_FRACTION) -> tuple[str, str]:
    """Splits text into (training part, held-out part): the last ``fraction`` is held out.

    The cut is moved forward to the next line start so no line is split; ``fraction = 1`` holds
    out everything.

    Raises:
        ValueError: ``fraction`` outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1], got {fraction}")
    cut = int(len(text) * (1.0 - fraction))
    if cut > 0:
        newline = text.find("\n", cut - 1)
        cut = len(text) if newline < 0 else newline + 1
    return text[:cut], text[cut:]


def read_text_file(path: PathLike) -> str:
    """The text of an existing UTF-8 text file.

    Raises:
        FileNotFoundError: missing file (or a folder).
        ValueError: ``{path} is not UTF-8 text`` (undecodable bytes or NUL characters).
    """
    raw = data_lib.require_file(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if "\0" in text:
        raise ValueError(f"{path} is not UTF-8 text (it has NUL bytes)")
    return text


def _heldout_text(path: PathLike, heldout_fraction: float, text: str | None = None) -> str:
    text = read_text_file(path) if text is None else text
    if not text.strip():
        raise ValueError(f"{path}: the text is empty")
    _, heldout = split_heldout(text, fraction=heldout_fraction)
    if not heldout.strip():
        n_lines = len(text.splitlines())
        raise ValueError(
            f"{path}: the held-out part (the last {heldout_fraction:.0%} of the file, from a "
            f"line start) is empty: the file has {n_lines} line(s); use a longer file or "
            f"--heldout 1 (the whole file)"
        )
    return heldout


def _text_path(path: PathLike | None, data_dir: PathLike | None) -> PathLike:
    if path is None:
        return data_lib.resolve_data_dir(data_dir) / "tinyshakespeare" / "input.txt"
    return path


def check_text_windows(
    path: PathLike | None = None,
    *,
    window: int,
    n_windows: int,
    heldout_fraction: float = HELDOUT_FRACTION,
    data_dir: PathLike | None = None,
    text: str | None = None,
    offset: int = 0,
) -> None:
    """The checks of ``text_windows`` that need no tokenizer, to run before a model loads.

    A window of ``window`` tokens needs at least ``window`` bytes of text (a token covers at
    least one byte in byte-level BPE and SentencePiece with byte fallback), so a held-out part
    with fewer bytes is certainly too short; ``text_windows`` counts the tokens exactly. The
    arguments are those of ``text_windows``.

    Raises:
        FileNotFoundError: missing file.
        ValueError: bad sizes, a file that is not UTF-8 text, an empty text or held-out part, or
            too few bytes for the windows.
    """
    if window <= 0 or n_windows <= 0 or offset < 0:
        raise ValueError(
            f"need window > 0, n_windows > 0, offset >= 0; got {window}, {n_windows}, {offset}"
        )
    path = _text_path(path, data_dir)
    n_bytes = len(_heldout_text(path, heldout_fraction, text).encode("utf-8"))
    if n_bytes < window:
        raise ValueError(
            f"{path} has only {n_bytes} bytes, so at most {n_bytes} tokens, in its held-out "
            f"part (the last {heldout_fraction:.0%}); need at least {window} for one window"
        )
    if n_bytes < offset + window * n_windows:
        after = f" after offset {offset}" if offset else ""
        raise ValueError(
            f"{path} has only {n_bytes} bytes, so at most {n_bytes} tokens, in its held-out "
            f"part (the last {heldout_fraction:.0%}); {n_windows} windows of {window}{after} "
            f"need {offset + window * n_windows} (lower --limit or --window)"
        )


def text_windows(
    path: PathLike | None = None,
    *,
    window: int,
    n_windows: int,
    tokenizer: Any,
    offset: int = 0,
    heldout_fraction: float = HELDOUT_FRACTION,
    data_dir: PathLike | None = None,
    text: str | None = None,
) -> np.ndarray:
    """Consecutive, non-overlapping token windows from the held-out part of a text file.

    The held-out part is the last ``heldout_fraction`` of the file (``split_heldout``); it is
    tokenized once, without special tokens, and windows start ``offset`` tokens into it.

    Args:
        path: the text file (default: the shared data's ``tinyshakespeare/input.txt``).
        window: tokens per window.
        n_windows: number of windows.
        tokenizer: a transformers tokenizer or a callable ``text -> token ids``.
        offset: tokens of the held-out part to skip first.
        heldout_fraction: the tail fraction of the file used (1.0 = the whole file).
        data_dir: the shared data folder (for the default path).
        text: the text itself, already read (``hub.wikitext_text``); ``path`` then only names
            it in messages.

    Returns:
        ``[n_windows, window]`` int32 token ids.

    Raises:
        FileNotFoundError: missing file.
        ValueError: a file that is not UTF-8 text, an empty text or held-out part, bad sizes,
            or too few tokens for the windows asked for.
    """
    if window <= 0 or n_windows <= 0 or offset < 0:
        raise ValueError(
            f"need window > 0, n_windows > 0, offset >= 0; got {window}, {n_windows}, {offset}"
        )
    path = _text_path(path, data_dir)
    heldout = _heldout_text(path, heldout_fraction, text)
    ids = np.asarray(token_ids(tokenizer, heldout), dtype=np.int64)
    if ids.size < offset + window:
        raise ValueError(
            f"{path} has only {ids.size} tokens in its held-out part (the last "
            f"{heldout_fraction:.0%}); need at least {offset + window} for one window"
        )
    need = offset + window * n_windows
    if ids.size < need:
        raise ValueError(
            f"{path}: held-out part ({heldout_fraction:.0%} of the file) has {ids.size} tokens; "
            f"{n_windows} windows of {window} after offset {offset} need {need} "
            f"(lower --limit or --window)"
        )
    return ids[offset:need].reshape(n_windows, window).astype(np.int32)
