"""Metrics of the evaluation suite against hand-computed values."""

import math
import random

import numpy as np
import pytest

from jaxkv.evals import metrics as metrics_lib


def _lcs_dp(a, b):
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = (
                table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
            )
    return table[-1][-1]


# ---- normalization, F1, ROUGE-L, exact match -----------------------------------------------------


def test_normalize_answer():
    assert metrics_lib.normalize_answer("  The Eiffel-Tower, in PARIS!  ") == "eiffeltower in paris"
    assert metrics_lib.normalize_answer("An apple a day") == "apple day"
    assert metrics_lib.normalize_answer("") == ""


def test_qa_f1_hand_computed():
    # pred -> "cat sat on mat" (4 tokens); ref -> "cat sat on red mat" (5 tokens).
    # common = {cat, sat, on, mat} = 4; P = 4/4 = 1, R = 4/5; F1 = 2 * 1 * 0.8 / 1.8 = 8/9.
    assert metrics_lib.qa_f1("The cat sat on the mat.", "A cat sat on a red mat") == pytest.approx(
        8 / 9
    )
    # duplicates count once per reference occurrence: common = 1, P = 1/3, R = 1, F1 = 0.5.
    assert metrics_lib.qa_f1("Paris paris France", "Paris") == pytest.approx(0.5)
    assert metrics_lib.qa_f1("Berlin", "Paris") == 0.0
    assert metrics_lib.qa_f1("", "Paris") == 0.0
    assert metrics_lib.qa_f1("the Paris.", "paris") == 1.0


def test_rouge_l_hand_computed():
    # pred has 7 tokens, ref 6; LCS = "the cat was under the bed" = 6.
    # P = 6/7, R = 1, F1 = 2 * (6/7) / (13/7) = 12/13.
    assert metrics_lib.rouge_l("The cat was found under the bed.", "the cat was under the bed") == (
        pytest.approx(12 / 13)
    )
    # [police killed the gunman] vs [the gunman killed police]: LCS = "the gunman" = 2;
    # P = R = 2/4, F1 = 0.5.
    assert metrics_lib.rouge_l(
        "police killed the gunman", "the gunman killed police"
    ) == pytest.approx(0.5)
    assert metrics_lib.rouge_l("", "anything") == 0.0
    assert metrics_lib.rouge_l("Same text!", "same, text") == 1.0


def test_lcs_matches_dynamic_programming():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 20))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 20))]
        assert metrics_lib.lcs_length(a, b) == _lcs_dp(a, b)
    assert metrics_lib.lcs_length("ABCBDAB", "BDCABA") == 4  # the textbook example (CLRS)


def test_exact_match():
    assert metrics_lib.exact_match("The Eiffel Tower!", "eiffel tower") == 1.0
    assert metrics_lib.exact_match("The Eiffel Tower!", "eiffel tower", normalize=False) == 0.0
    assert metrics_lib.exact_match(" 42 ", "42", normalize=False) == 1.0
    assert metrics_lib.exact_match("41", "42") == 0.0


# ---- LongBench metrics ---------------------------------------------------------------------------


def test_classification_score():
    classes = ["Location", "Human", "Human being"]
    # "Human" is matched only because it is inside the true class: dropped.
    assert (
        metrics_lib.classification_score("Human being", "Human being", all_classes=classes) == 1.0
    )
    assert (
        metrics_lib.classification_score(
            "Location or Human being", "Human being", all_classes=classes
        )
        == 0.5
    )
    assert metrics_lib.classification_score("Location", "Human being", all_classes=classes) == 0.0
    # two proper substrings of the truth are both dropped (the reference would skip one).
    assert (
        metrics_lib.classification_score("a b ab c", "ab c", all_classes=["a", "b", "ab c"]) == 1.0
    )


def test_retrieval_and_count_scores():
    assert metrics_lib.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert metrics_lib.retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert metrics_lib.retrieval_score("I cannot tell.", "Paragraph 12") == 0.0
    with pytest.raises(ValueError, match="Paragraph N"):
        metrics_lib.retrieval_score("Paragraph 1", "12")
    assert metrics_lib.count_score("There are 7 unique paragraphs.", "7") == 1.0
    assert metrics_lib.count_score("7 or 8", "7") == 0.5
    assert metrics_lib.count_score("seven", "7") == 0.0


def test_code_sim():
    pred = "\n```python\n# set x\nx = foo(1)\nprint(x)\n"
    assert metrics_lib.first_code_line(pred) == "x = foo(1)"
    # LCS("x = foo(1)", "x = foo(2)") = 9 characters; ratio = 2 * 9 / (10 + 10) = 0.9.
    assert metrics_lib.code_sim(pred, "x = foo(2)") == pytest.approx(0.9)
    assert metrics_lib.code_sim("return a", "return a") == 1.0
    assert metrics_lib.code_sim("# only a comment", "x = 1") == 0.0


def test_longbench_registry_and_score():
    assert set(metrics_lib.LONGBENCH_METRICS) == {
        "qa_f1_score",
        "rouge_score",
        "classification_score",
        "retrieval_score",
        "count_score",
        "code_sim_score",
    }
    # max over ground truths: F1 with "Paris" is 1, with "Paris, France" is 2/3.
    assert (
        metrics_lib.longbench_score("Paris", ["Paris, France", "Paris"], metric="qa_f1_score")
        == 1.0
    )
    assert metrics_lib.longbench_score(
        "Paris", ["Paris, France"], metric="qa_f1_score"
    ) == pytest.approx(2 / 3)
    # first line only: the second line's extra class would halve the score.
    pred = "\nLocation\nHuman being"
    kw = {"metric": "classification_score", "all_classes": ["Location", "Human being"]}
    assert metrics_lib.longbench_score(pred, ["Location"], first_line_only=True, **kw) == 1.0
    assert metrics_lib.longbench_score(pred, ["Location"], **kw) == 0.5
    with pytest.raises(ValueError, match="unknown LongBench metric"):
        metrics_lib.longbench_score("x", ["x"], metric="rouge_zh_score")
    with pytest.raises(ValueError, match="at least one"):
        metrics_lib.longbench_score("x", [], metric="qa_f1_score")


# ---- GSM8K and BBH extraction --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" Janet sells 16 - 3 - 4 = 9 eggs. She makes 9 * 2 = $18. The answer is 18.", "18"),
        (" The laptop costs $1,000 and the bag $234. The answer is $1,234.", "1234"),
        (" The laptop costs $1,000 and the bag $234, so the total is $1,234.", "1234"),
        (" 2 + 3 = 5. The answer is 5.\n\nQ: A farmer has 7 cows and 12 hens.", "5"),
        (" He has 5 apples left.\n\nQ: There are 7 trees.", "5"),
        (" The temperature fell by 3 degrees. The answer is -3.", "-3"),
        (" Each costs 18.00 dollars. The answer is $18.00.", "18"),
        (" Half of 5 is 2.5. The answer is 2.5.", "2.5"),
        (" 4 + 4 = 8.\nThe answer is: 8 pencils, up from 4.", "8"),
        (" First 3, then 10. The answer is 4. Later I said 99.", "4"),
        (" I am not sure how to solve this.", None),
        ("", None),
    ],
)
def test_gsm8k_extract(completion, expected):
    assert metrics_lib.gsm8k_extract(completion) == expected


def test_gsm8k_target():
    assert metrics_lib.gsm8k_target("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == "18"
    assert metrics_lib.gsm8k_target("...\n#### 1,234") == "1234"
    assert metrics_lib.gsm8k_target("...\n#### -5") == "-5"
    with pytest.raises(ValueError, match="####"):
        metrics_lib.gsm8k_target("no final line")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" Jan 3, 1963 is 01/03/1963. So the answer is (B).", "(B)"),
        (" ... So the answer is B.", "(B)"),
        (" ... So the answer is (B) 01/03/1963.", "(B)"),
        (" ... So the answer is **(C)**.", "(C)"),
        (" ... So the answer is False.", "False"),
        (" ... So the answer is ] ].", "] ]"),
        (" 3 * 8 = 24. So the answer is 24.\n\nQ: next question. So the answer is 7.", "24"),
        (" ... So the answer is A party.", "A party"),
        (" I do not know.", None),
    ],
)
def test_bbh_extract(completion, expected):
    assert metrics_lib.bbh_extract(completion) == expected


def test_bbh_match():
    assert metrics_lib.bbh_match(" So the answer is no.", "No") == 1.0
    assert metrics_lib.bbh_match(" So the answer is (A).", "(B)") == 0.0
    assert metrics_lib.bbh_match(" So the answer is apple  banana.", "apple banana") == 1.0
    assert metrics_lib.bbh_match(" no conclusion", "No") == 0.0


def test_retrieval_match():
    assert metrics_lib.retrieval_match(" 71432. Remember it.", "71432") == 1.0
    assert metrics_lib.retrieval_match("\n71432", "71432") == 1.0  # first non-empty line
    assert metrics_lib.retrieval_match(" 714321", "71432") == 0.0
    assert metrics_lib.retrieval_match(" I forgot.\n71432", "71432") == 0.0
    assert metrics_lib.retrieval_match("", "71432") == 0.0


# ---- KL, NLL, perplexity -------------------------------------------------------------------------


def test_kl_two_point_by_hand():
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
    kl = metrics_lib.kl_divergence(np.array([0.0, 0.0]), np.array([0.0, math.log(3.0)]))
    assert kl.shape == ()
    assert float(kl) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)


def test_kl_against_direct_formula():
    rng = np.random.default_rng(0)
    p_logits = rng.normal(size=(4, 3, 11)) * 3
    q_logits = rng.normal(size=(4, 3, 11)) * 3
    p = np.exp(p_logits) / np.exp(p_logits).sum(-1, keepdims=True)
    q = np.exp(q_logits) / np.exp(q_logits).sum(-1, keepdims=True)
    direct = np.sum(p * np.log(p / q), axis=-1)
    kl = metrics_lib.kl_divergence(p_logits, q_logits)
    assert kl.shape == (4, 3)
    np.testing.assert_allclose(kl, direct, rtol=1e-10, atol=1e-14)
    assert np.all(metrics_lib.kl_divergence(p_logits, p_logits) == 0.0)
    # stable for huge logits and invariant to a per-row shift
    np.testing.assert_allclose(
        metrics_lib.kl_divergence(p_logits + 1e4, q_logits - 1e4), kl, rtol=1e-8
    )
    with pytest.raises(ValueError, match="shapes differ"):
        metrics_lib.kl_divergence(p_logits, q_logits[..., :5])


def test_perplexity_of_uniform_logits_is_vocab_size():
    vocab = 37
    logits = np.zeros((5, vocab))
    nll = metrics_lib.token_nll(logits, np.array([0, 3, 36, 5, 1]))
    np.testing.assert_allclose(nll, np.log(vocab))
    assert metrics_lib.perplexity(nll) == pytest.approx(vocab)
    # exp(mean(ln 2, ln 8)) = exp(ln 4) = 4
    assert metrics_lib.perplexity([math.log(2), math.log(8)]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="empty"):
        metrics_lib.perplexity([])


def test_token_nll_by_hand():
    # logits (0, ln 3): p = (1/4, 3/4); NLL of token 1 = -ln(3/4).
    nll = metrics_lib.token_nll(np.array([[0.0, math.log(3.0)]]), np.array([1]))
    assert nll[0] == pytest.approx(-math.log(0.75))


# ---- agreement and error modes -------------------------------------------------------------------


def test_length_ratio():
    assert metrics_lib.length_ratio([10, 20], [10, 10]) == pytest.approx(1.5)
    assert metrics_lib.length_ratio(5, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="equal"):
        metrics_lib.length_ratio([1, 2], [1])
    with pytest.raises(ValueError, match="empty"):
        metrics_lib.length_ratio([0], [0])


def test_is_repetitive():
    assert not metrics_lib.is_repetitive("this is very very very good".split())
    assert metrics_lib.is_repetitive(("word " * 12).split())
    sentence = "the answer is five . "
    assert metrics_lib.is_repetitive((sentence * 3).split())  # 5-token block x 3 = 15 tokens
    assert not metrics_lib.is_repetitive((sentence * 2).split())
    natural = "Olivia had 23 dollars . 5 bagels for 3 dollars each will be 15 dollars . So she has 8 left ."
    assert not metrics_lib.is_repetitive(natural.split())
    assert metrics_lib.is_repetitive([7, 8, 9] * 5)  # token ids work too
    assert not metrics_lib.is_repetitive([])


def test_error_modes():
    ref = "Paris is the capital of France."
    kw = {"max_new_tokens": 64, "reference_len": 8}
    assert (
        metrics_lib.error_mode("paris is the capital of france", ref, candidate_len=7, **kw)
        == "match"
    )
    assert (
        metrics_lib.error_mode("It is Paris.", ref, candidate_len=4, correct=True, **kw) == "match"
    )
    assert metrics_lib.error_mode("Lyon is the capital.", ref, candidate_len=5, **kw) == "incorrect"
    loop = "Paris is the capital " * 16
    assert (
        metrics_lib.error_mode(loop, ref, candidate_len=64, **kw) == "repetitive"
    )  # loop beats length
    rambling = " ".join(f"word{i}" for i in range(64))
    assert metrics_lib.error_mode(rambling, ref, candidate_len=64, **kw) == "overlength"
    # both ran to the limit: not an overlength error of the compressed cache
    long_ref = {"max_new_tokens": 64, "reference_len": 64}
    assert metrics_lib.error_mode(rambling, ref, candidate_len=64, **long_ref) == "incorrect"
    assert (
        metrics_lib.error_mode("x", ref, candidate_len=1, correct=False, **kw)
        in metrics_lib.ERROR_MODES
    )


# ---- aggregation ---------------------------------------------------------------------------------


def test_mean_std():
    assert metrics_lib.mean_std([1.0, 2.0, 3.0]) == pytest.approx(
        (2.0, 1.0)
    )  # sample std, ddof = 1
    assert metrics_lib.mean_std([5.0]) == (5.0, 0.0)
    with pytest.raises(ValueError, match="no values"):
        metrics_lib.mean_std([])
