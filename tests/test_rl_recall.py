"""The recall training domain (jaxkv.rl.recall): every point ends a question whose answer starts
right after it and was stated earlier; no evaluation task's template, key or filler in it."""

import numpy as np
import pytest

from jaxkv.cli import train as train_cli
from jaxkv.evals import tasks
from jaxkv.evals.runner import ByteTokenizer
from jaxkv.policies import ranker as ranker_lib
from jaxkv.rl import ranker as rl_ranker
from jaxkv.rl import recall
from jaxkv.rl.data import RECALL_DOMAIN, domain_text

TOK = ByteTokenizer()
FILLER = np.asarray(TOK.encode("Some filler text, plain and long enough. " * 200), np.int32)
POINTS = (128, 256, 384, 512, 640)


def _text(ids) -> str:
    return TOK.decode(ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_point_ends_a_question_answered_right_after_it_by_an_earlier_fact(seed):
    rng = np.random.default_rng(seed)
    window, asked = recall.episode(TOK, FILLER, window=768, points=POINTS, rng=rng)
    assert window.shape == (768,) and window.dtype == np.int32
    assert [a["point"] for a in asked] == list(POINTS)
    for a in asked:
        fmt = {k: a[k] for k in ("name", "thing", "code")}
        p, fact = a["point"], recall.FACT.format(**fmt)
        question, answer = recall.QUESTION.format(**fmt), recall.ANSWER.format(**fmt)
        assert _text(window[:p]).endswith(question)
        assert _text(window[p : p + len(answer)]) == answer
        assert _text(window[a["fact_end"] - len(fact) : a["fact_end"]]) == fact
        assert a["fact_end"] <= p - len(question)  # stated before it is asked
    for before, a in zip(asked, asked[1:], strict=False):  # later questions: earlier segments'
        earlier = _text(window[: before["point"]])  # facts, each once until all were asked
        assert f" {a['name']}'s {a['thing']} is {a['code']}." in earlier
        done = {b["name"] for b in asked if b["point"] < a["point"]}
        stated = {n for n in recall.NAMES if f" {n}'s " in earlier}
        assert a["name"] not in done or done >= stated


def test_windows_are_deterministic_in_the_seed():
    a = recall.recall_windows(TOK, FILLER, n=3, window=768, points=POINTS, seed=[0, 1])
    b = recall.recall_windows(TOK, FILLER, n=3, window=768, points=POINTS, seed=[0, 1])
    c = recall.recall_windows(TOK, FILLER, n=3, window=768, points=POINTS, seed=[0, 2])
    assert a.shape == (3, 768)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_no_evaluation_task_template_key_or_word_is_in_it():
    templates = (recall.FACT, recall.QUESTION, recall.ANSWER)
    for phrase in ("pass key", "magic number", "Q:", "A:", "grass", "Remember it"):
        assert not any(phrase.lower() in t.lower() for t in templates)
    assert not set(recall.NAMES) & set(tasks.NEEDLE_WORDS)
    assert recall.FILLER_DOMAINS == ("math", "code")  # not passkey's grass, not needle's prose


def test_bad_layouts_are_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="increase strictly"):
        recall.episode(TOK, FILLER, window=768, points=(256, 128), rng=rng)
    with pytest.raises(ValueError, match="increase strictly"):
        recall.episode(TOK, FILLER, window=768, points=(128, 768), rng=rng)
    with pytest.raises(ValueError, match="too short"):
        recall.episode(TOK, FILLER, window=768, points=(64, 128), rng=rng)
    with pytest.raises(ValueError, match="too few"):
        recall.episode(TOK, FILLER[:500], window=768, points=POINTS, rng=rng)
    with pytest.raises(ValueError, match="token windows"):
        domain_text(RECALL_DOMAIN)


def test_the_ranker_trains_on_recall_windows_built_around_its_points(tmp_path):
    cfg = rl_ranker.RankerConfig(domains=("prose", RECALL_DOMAIN), windows_per_domain=2)
    windows = rl_ranker.domain_windows(TOK, cfg, split="train")
    assert windows[RECALL_DOMAIN].shape == (2, cfg.window)
    for row in windows[RECALL_DOMAIN]:
        for p in cfg.points:  # every point ends a question
            assert _text(row[:p]).rsplit("\n", 1)[-1].startswith("Quick check: what is ")
    out = tmp_path / "rk"
    argv = ["ranker", "--model", "tiny", "--windows-per-domain", "2", "--steps", "2"]
    assert train_cli.main([*argv, "--domains", "prose,recall", "--out", str(out)]) == 0
    _, meta = ranker_lib.load_ranker_params(out)
    assert meta["trained_on"] == ["prose", RECALL_DOMAIN]
    assert set(meta["validation"]) == {"prose", RECALL_DOMAIN}
