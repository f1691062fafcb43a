"""Metrics of the evaluation suite: pure Python / numpy, no model code.

Text metrics follow the reference evaluation scripts they reproduce (reimplemented, not copied):

* LongBench (THUDM/LongBench ``metrics.py``): ``qa_f1`` (SQuAD token F1 after ``normalize_answer``),
  ``rouge_l``, ``classification_score``, ``retrieval_score``, ``count_score``, ``code_sim``;
  ``LONGBENCH_METRICS`` maps the names of ``dataset2metric.json`` to them and ``longbench_score``
  takes the max over the ground-truth answers.
* GSM8K chain of thought (lm-evaluation-harness ``gsm8k-cot``): ``gsm8k_extract``,
  ``gsm8k_target``.
* BIG-Bench Hard chain of thought: ``bbh_extract`` / ``bbh_match``.

Distribution metrics: ``kl_divergence`` (per row, from logits), ``token_nll``, ``perplexity``.
Agreement with the full cache (paper Appendix F.3, F.5): ``length_ratio``, ``is_repetitive``,
``error_mode``. Seed aggregation: ``mean_std``.

Known, deliberate differences from the references:

* ``rouge_l`` is the token-level LCS F1 (beta = 1) on lower-cased alphanumeric tokens. LongBench
  calls the ``rouge`` package, whose ROUGE-L is summary-level (union LCS over sentences) with
  beta = P/R; the two agree on single-sentence texts of equal length and differ slightly otherwise.
* ``code_sim`` is the Levenshtein (indel) ratio ``2 * LCS / (len(a) + len(b))`` that
  ``fuzzywuzzy.fuzz.ratio`` computes with python-Levenshtein, but not rounded to whole percent.
* ``classification_score`` drops every class that is a proper substring of the ground truth; the
  reference removes items from the list it iterates over and so can skip some.
* The Chinese metrics (``qa_f1_zh_score``, ``rouge_zh_score``, ``retrieval_zh_score``) need the
  jieba segmenter, which is not a dependency: they are absent from ``LONGBENCH_METRICS``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ALNUM = re.compile(r"[a-z0-9]+")
_INT = re.compile(r"\d+")

ERROR_MODES = ("match", "repetitive", "incorrect", "overlength")


# ----------------------------------------------------------------------------------------------
# Text normalization and LCS


def normalize_answer(text: str) -> str:
    """Normalizes an answer as SQuAD / LongBench do.

    Lower-cases, removes ASCII punctuation, removes the articles a / an / the and collapses
    whitespace.

    Args:
        text: any string.

    Returns:
        The normalized string (words separated by single spaces).
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence of two sequences.

    Bit-parallel (Hyyrö 2004): one big-integer update per element of ``a``, so long texts stay
    fast in pure Python.

    Args:
        a: a sequence of hashable items (tokens or characters).
        b: another one.

    Returns:
        The LCS length.
    """
    if not a or not b:
        return 0
    masks: dict[Hashable, int] = {}
    for j, item in enumerate(b):
        masks[item] = masks.get(item, 0) | (1 << j)
    full = (1 << len(b)) - 1
    v = full
    for item in a:
        u = v & masks.get(item, 0)
        v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


def _f1(n_common: int, n_pred: int, n_ref: int) -> float:
    if n_common == 0:
        return 0.0
    precision = n_common / n_pred
    recall = n_common / n_ref
    return 2 * precision * recall / (precision + recall)


# ----------------------------------------------------------------------------------------------
# LongBench metrics


def qa_f1(prediction: str, ground_truth: str) -> float:
    """Token F1 between two answers after ``normalize_answer`` (LongBench ``qa_f1_score``).

    Args:
        prediction: the model's answer.
        ground_truth: one reference answer.

    Returns:
        F1 in [0, 1]; 0 when no token is shared (also when either side is empty).
    """
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(ground_truth).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    return _f1(common, len(pred), len(ref))


def rouge_tokens(text: str) -> list[str]:
    """The tokens ROUGE-L compares: lower-cased runs of ASCII letters and digits."""
    return _ALNUM.findall(text.lower())


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure: LCS-based F1 (beta = 1) over ``rouge_tokens``.

    Args:
        prediction: the candidate text.
        reference: the reference text.

    Returns:
        F1 in [0, 1]; 0 when either side has no token.
    """
    pred = rouge_tokens(prediction)
    ref = rouge_tokens(reference)
    return _f1(lcs_length(pred, ref), len(pred), len(ref))


def exact_match(prediction: str, reference: str, *, normalize: bool = True) -> float:
    """1.0 when the two strings are equal (after ``normalize_answer`` by default), else 0.0."""
    if normalize:
        prediction, reference = normalize_answer(prediction), normalize_answer(reference)
    else:
        prediction, reference = prediction.strip(), reference.strip()
    return float(prediction == reference)


def classification_score(
    prediction: str, ground_truth: str, *, all_classes: Sequence[str]
) -> float:
    """LongBench ``classification_score`` (TREC, LSHT).

    The classes named in the prediction are collected (substring test); a class that is a proper
    substring of the ground truth is dropped (it is matched because the true class contains it).

    Args:
        prediction: the model's answer.
        ground_truth: the true class name.
        all_classes: every class name of the dataset.

    Returns:
        1 / (number of matched classes) when the true class is among them, else 0.
    """
    matched = [c for c in all_classes if c in prediction]
    matched = [c for c in matched if not (c in ground_truth and c != ground_truth)]
    return 1.0 / len(matched) if ground_truth in matched else 0.0


def _fraction_equal(numbers: list[str], wanted: str) -> float:
    if not numbers:
        return 0.0
    return sum(n == wanted for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``retrieval_score``: the share of integers in the prediction equal to the id.

    Args:
        prediction: the model's answer, e.g. ``"Paragraph 7"``.
        ground_truth: ``"Paragraph N"``.

    Returns:
        (integers equal to N) / (integers in the prediction); 0 when it has none.

    Raises:
        ValueError: the ground truth names no ``Paragraph N``.
    """
    found = re.search(r"Paragraph (\d+)", ground_truth)
    if found is None:
        raise ValueError(f"retrieval ground truth must contain 'Paragraph N', got {ground_truth!r}")
    return _fraction_equal(_INT.findall(prediction), found.group(1))


def count_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``count_score``: the share of integers in the prediction equal to the count."""
    return _fraction_equal(_INT.findall(prediction), str(ground_truth).strip())


def first_code_line(prediction: str) -> str:
    """The first line of a code completion that is not a fence, comment or blank prefix.

    As LongBench: leading newlines are dropped and the first line without a backtick, ``#`` or
    ``//`` is taken; the empty string when there is none.
    """
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, ground_truth: str) -> float:
    """LongBench ``code_sim_score``: Levenshtein (indel) ratio of the first code line.

    Args:
        prediction: the model's completion (only its first code line is scored).
        ground_truth: the true next line.

    Returns:
        ``2 * LCS / (len(line) + len(ground_truth))`` over characters; 0 when either is empty.
    """
    line = first_code_line(prediction)
    if not line or not ground_truth:
        return 0.0
    return 2 * lcs_length(line, ground_truth) / (len(line) + len(ground_truth))


def _without_classes(fn: Callable[[str, str], float]) -> Callable[..., float]:
    def metric(prediction: str, ground_truth: str, *, all_classes: Sequence[str] = ()) -> float:
        del all_classes
        return fn(prediction, ground_truth)

    metric.__name__ = fn.__name__
    metric.__doc__ = fn.__doc__
    return metric


# name in dataset2metric.json -> metric(prediction, ground_truth, *, all_classes) -> float
LONGBENCH_METRICS: Mapping[str, Callable[..., float]] = {
    "qa_f1_score": _without_classes(qa_f1),
    "rouge_score": _without_classes(rouge_l),
    "classification_score": classification_score,
    "retrieval_score": _without_classes(retrieval_score),
    "count_score": _without_classes(count_score),
    "code_sim_score": _without_classes(code_sim),
}


def longbench_score(
    prediction: str,
    answers: Sequence[str],
    *,
    metric: str,
    all_classes: Sequence[str] = (),
    first_line_only: bool = False,
) -> float:
    """Scores one LongBench prediction: the max of the metric over the ground-truth answers.

    Args:
        prediction: the model's output.
        answers: the ground-truth answers (at least one).
        metric: a name of ``LONGBENCH_METRICS`` (``dataset2metric.json``).
        all_classes: the dataset's classes (classification only).
        first_line_only: keep only the first line of the prediction (TREC, TriviaQA, SAMSum,
            LSHT in LongBench's ``eval.py``).

    Returns:
        The score in [0, 1] (LongBench reports 100 x the mean over examples).

    Raises:
        ValueError: unknown metric or no answers.
    """
    if metric not in LONGBENCH_METRICS:
        raise ValueError(f"unknown LongBench metric {metric!r}; known: {sorted(LONGBENCH_METRICS)}")
    if not answers:
        raise ValueError("longbench_score needs at least one ground-truth answer")
    if first_line_only:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = LONGBENCH_METRICS[metric]
    return max(fn(prediction, answer, all_classes=all_classes) for answer in answers)


# ----------------------------------------------------------------------------------------------
# GSM8K and BBH answer extraction

_GSM8K_STRICT = re.compile(r"the answer is[:\s]*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)", re.IGNORECASE)
_GSM8K_NUMBER = re.compile(r"(?<![0-9])-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")
GSM8K_STOP = ("Q:", "</s>", "<|im_end|>")


def canonical_number(text: str) -> str:
    """Canonical string of a number as written: no ``$``, commas or trailing period.

    A fractional part of only zeros is dropped (``"18.00"`` -> ``"18"``), so that an answer written
    with cents matches an integer target.
    """
    text = text.strip().replace("$", "").replace(",", "").rstrip(".")
    if re.fullmatch(r"-?[0-9]+\.0+", text):
        text = text.split(".")[0]
    return "0" if text == "-0" else text


def truncate_at(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stops`` (the whole text when none occurs)."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def gsm8k_extract(completion: str, *, stops: Sequence[str] = GSM8K_STOP) -> str | None:
    """The final numeric answer of a GSM8K chain-of-thought completion.

    The completion is first cut at the harness's stop sequences (a model that keeps going writes
    the next ``Q:``). Then the first ``The answer is N`` wins (case-insensitive, ``$`` allowed,
    as the harness's strict-match filter); otherwise the last number in the text (its
    flexible-extract filter). The number goes through ``canonical_number``.

    Args:
        completion: the generated text after the prompt's final ``A:``.
        stops: stop sequences to cut at.

    Returns:
        The canonical number string, or None when the text has no number.
    """
    text = truncate_at(completion, stops)
    strict = _GSM8K_STRICT.search(text)
    if strict is not None:
        return canonical_number(strict.group(1))
    numbers = _GSM8K_NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


def gsm8k_target(answer: str) -> str:
    """The reference number of a GSM8K solution: what follows ``####``, canonicalized.

    Raises:
        ValueError: the solution has no ``####`` line.
    """
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####': {answer[-80:]!r}")
    return canonical_number(answer.split("####")[-1])


_BBH_ANSWER = re.compile(r"the answer is\s*(.*)", re.IGNORECASE)
_BBH_OPTION = re.compile(r"^\(([A-R])\)|^([A-R])$")
BBH_STOP = ("\n\nQ:",)


def bbh_extract(completion: str, *, stops: Sequence[str] = BBH_STOP) -> str | None:
    """The answer of a BIG-Bench Hard chain-of-thought completion.

    As the standard BBH evaluation: the text after the first "So the answer is" up to the end of
    that line, stripped of whitespace, Markdown ``*`` / quotes and the trailing period. A
    multiple-choice answer becomes its option in parentheses (``"(B) 01/03/1963"``, ``"B"`` and
    ``"(B)."`` all give ``"(B)"``), the form of the BBH targets; a letter not in parentheses counts
    only when it is the whole answer.

    Args:
        completion: the generated text after "A: Let's think step by step.".
        stops: stop sequences to cut at first.

    Returns:
        The answer string, or None when the completion never says "the answer is".
    """
    found = _BBH_ANSWER.search(truncate_at(completion, stops))
    if found is None:
        return None
    answer = found.group(1).strip().strip("*\"'` ").rstrip(".").strip()
    option = _BBH_OPTION.match(answer)
    if option is not None:
        return f"({option.group(1) or option.group(2)})"
    return answer


def bbh_match(completion: str, target: str) -> float:
    """1.0 when ``bbh_extract(completion)`` equals the target (case and spacing ignored)."""
    answer = bbh_extract(completion)
    if answer is None:
        return 0.0
    return float(" ".join(answer.lower().split()) == " ".join(target.lower().split()))


def retrieval_match(completion: str, key: str) -> float:
    """Passkey / needle scoring: 1.0 when ``key`` is in the first non-empty completion line.

    The key must stand alone as a number (``"71432"`` does not match inside ``"714321"``).
    """
    lines = [line for line in completion.split("\n") if line.strip()]
    if not lines:
        return 0.0
    pattern = rf"(?<![0-9]){re.escape(key)}(?![0-9])"
    return float(re.search(pattern, lines[0]) is not None)


# ----------------------------------------------------------------------------------------------
# Distribution metrics


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - np.max(x, axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, where P = softmax(p_logits) and Q = softmax(q_logits).

    Computed from log-softmax in float64 (stable for large logits); P is the full-cache
    distribution and Q the pruned one in the fidelity evaluation.

    Args:
        p_logits: ``[..., V]`` logits of P.
        q_logits: ``[..., V]`` logits of Q (same shape).

    Returns:
        ``[...]`` KL in nats, clipped at 0 (rounding can make identical rows give -1e-17).

    Raises:
        ValueError: shapes differ.
    """
    p_logits, q_logits = np.asarray(p_logits), np.asarray(q_logits)
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit shapes differ: {p_logits.shape} vs {q_logits.shape}")
    logp, logq = log_softmax(p_logits), log_softmax(q_logits)
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)
    return np.maximum(kl, 0.0)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target token: ``-log softmax(logits)[..., target]``.

    Args:
        logits: ``[..., V]`` next-token logits.
        targets: ``[...]`` integer token ids.

    Returns:
        ``[...]`` NLL in nats (float64).
    """
    logp = log_softmax(logits)
    idx = np.asarray(targets)[..., None]
    return -np.take_along_axis(logp, idx, axis=-1)[..., 0]


def perplexity(nll_values: Sequence[float] | np.ndarray) -> float:
    """Perplexity ``exp(mean NLL)`` of per-token negative log-likelihoods (nats).

    Raises:
        ValueError: no values.
    """
    nll = np.asarray(nll_values, dtype=np.float64).ravel()
    if nll.size == 0:
        raise ValueError("perplexity of an empty sequence of NLL values")
    return float(np.exp(np.mean(nll)))


# ----------------------------------------------------------------------------------------------
# Agreement with the full cache and error modes (paper Appendix F.3, F.5)


def length_ratio(
    candidate_lengths: int | Sequence[int], reference_lengths: int | Sequence[int]
) -> float:
    """Response-length ratio: mean candidate length / mean reference (full-cache) length.

    Args:
        candidate_lengths: generated-token count(s) under the compressed cache.
        reference_lengths: the matching count(s) under the full cache.

    Returns:
        The ratio of means (1.03 means responses 3 % longer than the full cache's).

    Raises:
        ValueError: different numbers of items, none, or a zero reference mean.
    """
    cand = np.atleast_1d(np.asarray(candidate_lengths, dtype=np.float64))
    ref = np.atleast_1d(np.asarray(reference_lengths, dtype=np.float64))
    if cand.shape != ref.shape or cand.size == 0:
        raise ValueError(f"length_ratio needs equal, non-empty inputs: {cand.shape} vs {ref.shape}")
    if ref.mean() <= 0:
        raise ValueError("length_ratio: the reference responses are all empty")
    return float(cand.mean() / ref.mean())


def is_repetitive(
    tokens: Sequence[Hashable], *, max_period: int = 32, min_repeats: int = 3, min_span: int = 12
) -> bool:
    """Whether a token sequence contains a loop.

    A loop is a block of ``p <= max_period`` tokens repeated back to back at least
    ``min_repeats`` times, covering at least ``min_span`` tokens in all (so "very very very" is
    not a loop, but a sentence said three times, or one word twelve times, is).

    Args:
        tokens: the generated tokens (words or ids).
        max_period: the longest block length searched.
        min_repeats: consecutive copies of the block needed.
        min_span: tokens the repeated region must cover.

    Returns:
        True when such a loop exists.
    """
    ids = np.asarray(_as_ids(tokens))
    for period in range(1, max_period + 1):
        need = max((min_repeats - 1) * period, min_span - period)
        if ids.size - period < need:
            break
        if _longest_true_run(ids[period:] == ids[:-period]) >= need:
            return True
    return False


def _as_ids(tokens: Sequence[Hashable]) -> list[int]:
    vocab: dict[Hashable, int] = {}
    return [vocab.setdefault(t, len(vocab)) for t in tokens]


def _longest_true_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return int(np.max(edges[1::2] - edges[::2]))


def error_mode(
    candidate: str,
    reference: str,
    *,
    max_new_tokens: int,
    candidate_len: int,
    reference_len: int,
    correct: bool | None = None,
    candidate_tokens: Sequence[Hashable] | None = None,
) -> str:
    """Classifies a compressed-cache generation against the full-cache one (Appendix F.3).

    Meant for instances the full cache solves. Checked in this order:

    1. ``"match"``: the candidate is correct (``correct=True``, judged by the task metric); when
       ``correct`` is None, its normalized text (``normalize_answer``) equals the reference's.
    2. ``"repetitive"``: the candidate loops (``is_repetitive`` on ``candidate_tokens``, by
       default its whitespace words). A loop that runs into the token limit counts here, since
       the loop is the cause.
    3. ``"overlength"``: the candidate hit the limit (``candidate_len >= max_new_tokens``) while
       the reference stopped before it.
    4. ``"incorrect"``: anything else (a wrong final answer of normal length).

    Args:
        candidate: the compressed-cache generation.
        reference: the full-cache generation.
        max_new_tokens: the generation limit both ran under.
        candidate_len: tokens the candidate generated.
        reference_len: tokens the reference generated.
        correct: the task metric's verdict on the candidate, if it has one.
        candidate_tokens: the candidate's tokens for the loop test (default: its words).

    Returns:
        One of ``ERROR_MODES``.
    """
    if correct is None:
        correct = normalize_answer(candidate) == normalize_answer(reference)
    if correct:
        return "match"
    tokens = candidate.split() if candidate_tokens is None else candidate_tokens
    if is_repetitive(tokens):
        return "repetitive"
    if candidate_len >= max_new_tokens and reference_len < max_new_tokens:
        return "overlength"
    return "incorrect"


# ----------------------------------------------------------------------------------------------
# Aggregation


def mean_std(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1) over seeds; std is 0 for a single value.

    Raises:
        ValueError: no values.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("mean_std of no values")
    std = float(np.std(x, ddof=1)) if x.size > 1 else 0.0
    return float(np.mean(x)), std


__all__ = [
    "ERROR_MODES",
    "LONGBENCH_METRICS",
    "bbh_extract",
    "bbh_match",
    "canonical_number",
    "classification_score",
    "code_sim",
    "count_score",
    "error_mode",
    "exact_match",
    "first_code_line",
    "gsm8k_extract",
    "gsm8k_target",
    "is_repetitive",
    "kl_divergence",
    "lcs_length",
    "length_ratio",
    "log_softmax",
    "longbench_score",
    "mean_std",
    "normalize_answer",
    "perplexity",
    "qa_f1",
    "retrieval_match",
    "retrieval_score",
    "rouge_l",
    "rouge_tokens",
    "token_nll",
    "truncate_at",
]
