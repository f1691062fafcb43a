"""The ``recall`` training domain: token windows that quiz the model on facts it read earlier.

A ranker trained on natural text learns what the next queries attend to there, where
accumulated and recent attention predict it well; it never sees a prompt whose last query looks
up one span far back, the shape of a retrieval question (``results/retrieval_ranker/
diagnosis.md``). A recall window is filler text with short facts in it (``"Mara's locker code is
4821."``); every training point P of the window is the end of a question about one of the facts
read before it, and the tokens from P on start with its answer. So at P the cache's statistics
hold the question's attention, and the next queries' attention (the ranker's target) goes to
the fact that answers it.

Nothing here is an evaluation task: the filler is the training domains' math and code text
(passkey's is repeated grass sentences, needle's Shakespeare), the facts are people's codes
and numbers (needle's keys are nouns' "special magic numbers", passkey's one "pass key"), and
the question and answer templates share no sentence with either.

Layout of one window (``episode``): the points P_1 < ... < P_m cut it into m + 1 segments.
Segment i holds, in order, the answer to the question ending at P_i (none in the first), filler
with one or two new facts at random places, and a question ending exactly at P_{i+1} (none in
the last). The first segment's question asks about its own first fact, which opens the
segment; every later one asks about a fact of an earlier segment, drawn at random among those
not asked about yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.evals.tasks import token_ids

NAMES = tuple(
    "Mara Tobias Ingrid Rafael Selma Dorian Yusuf Helena Oskar Priya Lionel Amara Bastian "
    "Noemi Casimir Ruth Emeka Solveig Thaddeus Leila Anselm Greta Idris Marisol Konrad Wanda "
    "Florin Odette Nikhil Rosalind Emil Zofia Desmond Ilse Matteo Farida Gideon Liesel Quentin "
    "Beatrix".split()
)
THINGS = ("locker code", "room number", "ticket number", "order number", "badge number")
FACT = " {name}'s {thing} is {code}."
QUESTION = "\nQuick check: what is {name}'s {thing}? {name}'s {thing} is"
ANSWER = " {code}.\n"
FILLER_DOMAINS = ("math", "code")  # the training domains whose text is the filler
FACTS_PER_SEGMENT = 2  # at most; one when two do not fit
_EMPTY = np.zeros(0, np.int32)


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(token_ids(tokenizer, text), np.int32)


def _fact(tokenizer, name: str, rng: np.random.Generator) -> dict:
    """A fact about ``name``: its text pieces' ids (fact, question, answer) and its code."""
    fmt = {"name": name, "thing": THINGS[int(rng.integers(len(THINGS)))]}
    fmt["code"] = str(int(rng.integers(1000, 1_000_000)))
    ids = {
        k: _ids(tokenizer, t.format(**fmt))
        for k, t in (("fact", FACT), ("question", QUESTION), ("answer", ANSWER))
    }
    return fmt | ids


def _draw(stated: list[dict], asked: list[dict], rng: np.random.Generator) -> dict:
    """A fact of ``stated`` not asked about yet, at random (any fact once all were asked)."""
    done = {a["name"] for a in asked}
    fresh = [f for f in stated if f["name"] not in done] or stated
    return fresh[int(rng.integers(len(fresh)))]


def episode(
    tokenizer,
    filler_ids: np.ndarray,
    *,
    window: int,
    points: Sequence[int],
    rng: np.random.Generator,
) -> tuple[np.ndarray, list[dict]]:
    """One recall window [window] (module docstring) and what each point's question asks:
    ``{"point", "name", "thing", "code", "fact_end"}`` (``fact_end``: the token after the fact).

    Raises:
        ValueError: points not strictly increasing inside the window, a segment too short for
            its answer, question and one fact, or filler shorter than a window.
    """
    bounds = [0, *points, window]
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"points must increase strictly inside (0, {window}): {tuple(points)}")
    if filler_ids.size <= window:
        raise ValueError(
            f"{filler_ids.size} tokens of filler are too few for a {window}-token window"
        )
    names = [str(x) for x in rng.permutation(NAMES)]
    stated: list[dict] = []  # facts of the earlier segments, with their fact_end
    asked: list[dict] = []
    segments: list[np.ndarray] = []
    answer = _EMPTY
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        last = i == len(bounds) - 2
        here = [_fact(tokenizer, names.pop(), rng)]
        target = None if last else _draw(stated, asked, rng) if stated else here[0]
        question = _EMPTY if target is None else target["question"]
        room = hi - lo - answer.size - question.size
        if here[0]["fact"].size > room:
            raise ValueError(
                f"segment [{lo}, {hi}) is too short for an answer, a fact and a question"
            )
        while len(here) < FACTS_PER_SEGMENT:
            extra = _fact(tokenizer, names.pop(), rng)
            if sum(f["fact"].size for f in here) + extra["fact"].size > room:
                break
            here.append(extra)
        n_fill = room - sum(f["fact"].size for f in here)
        cuts = np.sort(rng.integers(0, n_fill + 1, size=len(here)))
        if target is here[0]:
            cuts[0] = 0  # the fact asked about in its own segment opens it
        start = int(rng.integers(0, filler_ids.size - n_fill + 1))
        fill = filler_ids[start : start + n_fill]
        parts, at, pos = [answer], 0, lo + answer.size
        for cut, fact in zip(cuts, here, strict=True):
            parts += [fill[at:cut], fact["fact"]]
            pos += int(cut) - at + fact["fact"].size
            at = int(cut)
            fact["fact_end"] = pos
        segments.append(np.concatenate([*parts, fill[at:], question]).astype(np.int32))
        if target is not None:
            asked.append(
                {k: target[k] for k in ("name", "thing", "code", "fact_end")} | {"point": hi}
            )
            answer = target["answer"]
        stated += here
    return np.concatenate(segments), asked


def recall_windows(
    tokenizer,
    filler_ids: np.ndarray,
    *,
    n: int,
    window: int,
    points: Sequence[int],
    seed: Sequence[int] | int,
) -> np.ndarray:
    """[n, window] recall windows (``episode``), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [episode(tokenizer, filler_ids, window=window, points=points, rng=rng)[0] for _ in range(n)]
    )
