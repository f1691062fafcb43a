"""Task builders on the data shipped with jaxkv and on small files the tests write."""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from jaxkv import data as data_lib
from jaxkv.evals import metrics as metrics_lib
from jaxkv.evals import tasks as tasks_lib

DATA = data_lib.shipped_data_dir()


def _word_ids():
    """A whitespace tokenizer returning ids (a fresh vocabulary per call of this factory)."""
    vocab = {}
    return lambda text: [vocab.setdefault(w, len(vocab)) for w in text.split()]


# ---- data folder ---------------------------------------------------------------------------------


def test_default_data_dir_and_env_override(monkeypatch, tmp_path):
    monkeypatch.delenv(data_lib.DATA_DIR_ENV, raising=False)
    assert data_lib.default_data_dir() == Path(tasks_lib.__file__).resolve().parents[1] / "data"
    assert (data_lib.default_data_dir() / "gsm8k" / "test.jsonl").is_file()
    monkeypatch.setenv(data_lib.DATA_DIR_ENV, str(tmp_path))
    assert data_lib.default_data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "gsm8k"))):
        tasks_lib.gsm8k_examples(limit=1)


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="exemplars.json"):
        tasks_lib.gsm8k_examples(data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "bbh" / "bbh"))):
        tasks_lib.bbh_examples("date_understanding", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        tasks_lib.text_windows(tmp_path / "nope.txt", window=4, n_windows=1, tokenizer=_word_ids())


def test_example_is_frozen():
    ex = tasks_lib.Example(id="a", prompt="p", target="t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.prompt = "q"


# ---- GSM8K ---------------------------------------------------------------------------------------


def test_gsm8k_prompt_has_the_8_exemplars_and_targets_parse():
    spec = json.loads((DATA / "gsm8k/lm_eval_harness/gsm8k_cot_8shot_exemplars.json").read_text())
    records = [json.loads(line) for line in (DATA / "gsm8k/test.jsonl").read_text().splitlines()]
    examples = tasks_lib.gsm8k_examples(limit=4)
    assert len(examples) == 4
    for ex, record in zip(examples, records, strict=False):
        for shot in spec["exemplars"]:
            assert f"Q: {shot['question']}\nA: {shot['target']}\n\n" in ex.prompt
        assert ex.prompt.count("Q: ") == 9
        assert ex.prompt.endswith(f"\n\nQ: {record['question']}\nA:")
        assert ex.target == metrics_lib.gsm8k_target(record["answer"])
        assert ex.meta["max_new_tokens"] == 512 and "Q:" in ex.meta["stop"]
    # the exemplars' own answers extract to the number they state
    for shot in spec["exemplars"]:
        stated = re.search(r"The answer is (\d+)\.", shot["target"]).group(1)
        assert metrics_lib.gsm8k_extract(" " + shot["target"]) == stated


def test_gsm8k_all_test_targets_are_numbers_and_options():
    examples = tasks_lib.gsm8k_examples(n_shot=0)
    assert len(examples) == 1319
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", ex.target) for ex in examples)
    assert examples[0].prompt.startswith("Q: ") and examples[0].prompt.count("Q: ") == 1
    assert tasks_lib.gsm8k_examples(limit=0) == []
    with pytest.raises(ValueError, match="n_shot"):
        tasks_lib.gsm8k_examples(n_shot=9, limit=1)
    with pytest.raises(ValueError, match="split"):
        tasks_lib.gsm8k_examples("validation")


# ---- BBH -----------------------------------------------------------------------------------------


def test_bbh_prompt_format():
    examples = tasks_lib.bbh_examples("date_understanding", limit=3)
    assert len(examples) == 3
    for ex in examples:
        assert "canary" not in ex.prompt and "-----" not in ex.prompt
        assert ex.prompt.startswith("Infer the date from context.")
        assert ex.prompt.count("Q: ") == 4  # 3 exemplars + the question
        assert ex.prompt.endswith("\nA: Let's think step by step.")
        assert re.fullmatch(r"\([A-F]\)", ex.target)


def test_bbh_unknown_task_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown BBH task 'date'.*date_understanding"):
        tasks_lib.bbh_examples("date")
    assert len(tasks_lib.bbh_tasks()) == 27


def test_bbh_exemplar_answers_extract_to_target_values():
    """For each task, the 3 exemplar answers extract to values of the task's target kind."""
    for task in tasks_lib.bbh_tasks():
        targets = {ex.target.lower() for ex in tasks_lib.bbh_examples(task)}
        answers = tasks_lib.bbh_fewshot_prefix(task).split("\n\nQ: ")[1:]
        assert len(answers) == 3, task
        for answer in answers:
            got = metrics_lib.bbh_extract(answer.split("\nA: ", 1)[1])
            assert got is not None, task
            if len(targets) <= 20:  # closed answer set: the answer is one of the targets
                assert got.lower() in targets, (task, got)


# ---- LongBench -----------------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def _record(i, **extra):
    return {
        "input": f"Who wrote book {i}?",
        "context": f"Passage {i}: Book {i} was written by Ada {{braces}} Lovelace.",
        "answers": [f"Ada Lovelace {i}"],
        "length": 12,
        "all_classes": None,
        "_id": f"id{i}",
        **extra,
    }


def test_longbench_reads_and_formats(tmp_path):
    path = _write_jsonl(tmp_path / "hotpotqa_e.jsonl", [_record(0), "\n", _record(1)])
    examples = tasks_lib.longbench_examples(path)
    assert [ex.id for ex in examples] == ["id0", "id1"]
    ex = examples[0]
    assert "Passage 0: Book 0 was written by Ada {braces} Lovelace." in ex.prompt
    assert ex.prompt.endswith("Question: Who wrote book 0?\nAnswer:")
    assert "{context}" not in ex.prompt and "{input}" not in ex.prompt
    assert ex.target == ("Ada Lovelace 0",)
    assert ex.meta["dataset"] == "hotpotqa"
    assert ex.meta["metric"] == "qa_f1_score"
    assert ex.meta["max_new_tokens"] == 32
    assert ex.meta["chat_template"] and not ex.meta["first_line_only"]
    score = metrics_lib.longbench_score(" Ada Lovelace 0", ex.target, metric=ex.meta["metric"])
    assert score == 1.0
    assert len(tasks_lib.longbench_examples(path, limit=1)) == 1


def test_longbench_classification_meta(tmp_path):
    row = _record(0, answers=["Location"], all_classes=["Location", "Human being"])
    path = _write_jsonl(tmp_path / "data.jsonl", [row])
    (ex,) = tasks_lib.longbench_examples(path, dataset="trec")
    assert ex.meta["all_classes"] == ("Location", "Human being")
    assert ex.meta["first_line_only"] and not ex.meta["chat_template"]
    score = metrics_lib.longbench_score(
        "Location\nHuman being",
        ex.target,
        metric=ex.meta["metric"],
        all_classes=ex.meta["all_classes"],
        first_line_only=ex.meta["first_line_only"],
    )
    assert score == 1.0
    missing = _write_jsonl(tmp_path / "trec.jsonl", [_record(0, answers=["Location"])])
    with pytest.raises(ValueError, match=r"trec\.jsonl:1: missing required field.*all_classes"):
        tasks_lib.longbench_examples(missing)


def test_longbench_malformed_line_reports_its_number(tmp_path):
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", [_record(0), _record(1), '{"input": oops\n'])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:3: malformed JSON"):
        tasks_lib.longbench_examples(path)
    # lazily, the good lines come first
    it = tasks_lib.iter_longbench_examples(path)
    assert [next(it).id, next(it).id] == ["id0", "id1"]
    with pytest.raises(ValueError, match=":3:"):
        next(it)


def test_longbench_missing_field_and_bad_names(tmp_path):
    bad = _record(1)
    del bad["answers"]
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", [_record(0), bad])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl:2: missing required field.*answers"):
        tasks_lib.longbench_examples(path)
    with pytest.raises(ValueError, match="non-empty list"):
        tasks_lib.longbench_examples(
            _write_jsonl(tmp_path / "x.jsonl", [_record(0, answers=[])]), dataset="qasper"
        )
    with pytest.raises(ValueError, match="unknown LongBench dataset 'nosuch'"):
        tasks_lib.longbench_examples(path, dataset="nosuch")
    with pytest.raises(ValueError, match="jieba"):
        tasks_lib.longbench_examples(path, dataset="dureader")
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        tasks_lib.longbench_examples(tmp_path / "absent.jsonl", dataset="hotpotqa")


@pytest.mark.parametrize(
    "field, value, want",
    [
        ("answers", "Ada Lovelace", "a non-empty list of strings"),
        ("answers", ["Ada", 7], "a non-empty list of strings"),
        ("answers", {"a": "Ada"}, "a non-empty list of strings"),
        ("context", ["Passage"], "a string"),
        ("context", 17, "a string"),
        ("input", {"q": "?"}, "a string"),
        ("length", "12", "an integer"),
        ("length", 12.5, "an integer"),
        ("length", True, "an integer"),
        ("all_classes", "Location", "a list of strings or null"),
        ("_id", ["id"], "a string"),
    ],
)
def test_longbench_rejects_fields_of_the_wrong_type(tmp_path, field, value, want):
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", [_record(0), _record(1, **{field: value})])
    with pytest.raises(ValueError, match=rf"hotpotqa\.jsonl:2: field '{field}' must be {want}"):
        tasks_lib.longbench_examples(path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_longbench_file_without_records_is_an_error(tmp_path, text):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl: no records"):
        tasks_lib.longbench_examples(path)
    with pytest.raises(ValueError, match="no records"):
        list(tasks_lib.iter_longbench_examples(path))


def test_longbench_binary_file_is_not_text(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\x89PNG")
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl is not UTF-8 text"):
        tasks_lib.longbench_examples(path)


def test_longbench_config_metric_names_are_registered():
    config = tasks_lib.load_longbench_config()
    english = {d: m for d, m in config.metric.items() if not m.endswith("zh_score")}
    assert len(english) == 17  # the 16 English datasets and LSHT (classification)
    assert set(english.values()) == set(metrics_lib.LONGBENCH_METRICS)


def test_truncate_middle():
    assert tasks_lib.truncate_middle(range(10), 4) == [0, 1, 8, 9]
    assert tasks_lib.truncate_middle([1, 2, 3], 8) == [1, 2, 3]


# ---- passkey and needle --------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [500, 2000])
def test_passkey_prompts(n_tokens):
    examples = tasks_lib.passkey_examples(n_tokens=n_tokens, n=4, seed=3, tokenizer=str.split)
    assert len({ex.target for ex in examples}) == 4
    for ex in examples:
        assert re.fullmatch(r"\d{5}", ex.target)
        assert ex.prompt.count(ex.target) == 1
        assert ex.prompt.endswith("The pass key is")
        assert abs(len(ex.prompt.split()) - n_tokens) <= 0.1 * n_tokens
        assert ex.meta["n_tokens"] == len(ex.prompt.split())
        assert 0.0 <= ex.meta["depth"] <= 1.0
        assert metrics_lib.retrieval_match(f" {ex.target}. Remember it.", ex.target) == 1.0
    again = tasks_lib.passkey_examples(n_tokens=n_tokens, n=4, seed=3, tokenizer=str.split)
    assert again == examples
    other = tasks_lib.passkey_examples(n_tokens=n_tokens, n=4, seed=4, tokenizer=str.split)
    assert [ex.prompt for ex in other] != [ex.prompt for ex in examples]


def test_passkey_key_depth_and_count_callback():
    filler = tasks_lib.GRASS_FILLER * 400
    count = lambda text: len(text) // 4  # a callback returning the count itself
    examples = tasks_lib.passkey_examples(
        n_tokens=1000, n=6, seed=0, tokenizer=count, filler=filler
    )
    for ex in examples:
        assert abs(count(ex.prompt) - 1000) <= 100
        position = ex.prompt.index(ex.target) / len(ex.prompt)
        assert abs(position - ex.meta["depth"]) < 0.1
    with pytest.raises(ValueError, match="no room"):
        tasks_lib.passkey_examples(n_tokens=20, n=1, seed=0, tokenizer=str.split, filler=filler)


def test_needle_prompts():
    examples = tasks_lib.needle_examples(
        n_tokens=1000, n=3, seed=0, tokenizer=str.split, n_distractors=2
    )
    for ex in examples:
        word = ex.meta["word"]
        assert re.fullmatch(r"\d{7}", ex.target)
        assert ex.prompt.count(ex.target) == 1
        assert f"magic numbers for {word} is: {ex.target}." in ex.prompt
        assert ex.prompt.count("special magic numbers for") == 3
        assert ex.prompt.endswith(f"number for {word} mentioned in the text above is")
        assert abs(len(ex.prompt.split()) - 1000) <= 100


# ---- held-out text windows -----------------------------------------------------------------------


def test_split_heldout():
    text = "".join(f"line {i}\n" for i in range(100))
    train, heldout = tasks_lib.split_heldout(text)
    assert train + heldout == text
    assert heldout.startswith("line ") and train.endswith("\n")
    assert abs(len(heldout) - 0.1 * len(text)) <= len("line 99\n")
    assert tasks_lib.split_heldout(text, fraction=1.0) == ("", text)
    with pytest.raises(ValueError, match="fraction"):
        tasks_lib.split_heldout(text, fraction=0.0)


def test_text_windows_exact_and_consecutive(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"w{i}\n" for i in range(1000)))
    tokenizer = _word_ids()
    windows = tasks_lib.text_windows(path, window=16, n_windows=3, offset=5, tokenizer=tokenizer)
    assert windows.shape == (3, 16) and windows.dtype == np.int32
    _, heldout = tasks_lib.split_heldout(path.read_text())
    ids = tokenizer(heldout)
    np.testing.assert_array_equal(windows.ravel(), ids[5 : 5 + 48])
    # 4,890 characters; 90 % = 4,401 falls inside line "w902" (chars 4,400-4,404), so the
    # held-out part starts at the next line
    assert heldout.split()[0] == "w903" and windows[0, 0] == ids[5]


def test_text_windows_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n ")
    short = tmp_path / "short.txt"
    short.write_text("one two three four five six seven eight nine ten\n" * 10)
    kw = {"window": 8, "n_windows": 2, "tokenizer": _word_ids()}
    with pytest.raises(ValueError, match="empty"):
        tasks_lib.text_windows(empty, **kw)
    with pytest.raises(ValueError, match="empty"):
        tasks_lib.text_windows(blank, **kw)
    with pytest.raises(ValueError, match="has 10 tokens.*need 16"):
        tasks_lib.text_windows(short, **kw)
    with pytest.raises(ValueError, match="window > 0"):
        tasks_lib.text_windows(short, window=0, n_windows=1, tokenizer=_word_ids())


def test_text_files_that_cannot_give_a_window_are_named(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    nul = tmp_path / "nul.txt"
    nul.write_text("text\0" * 500)
    one_line = tmp_path / "one.txt"
    one_line.write_text("a single line of text without a break " * 40)
    short = tmp_path / "short.txt"
    short.write_text("one two three\n" * 30)
    for path in (binary, nul):
        with pytest.raises(ValueError, match=rf"{path.name} is not UTF-8 text"):
            tasks_lib.check_text_windows(path, window=8, n_windows=1)
        with pytest.raises(ValueError, match=rf"{path.name} is not UTF-8 text"):
            tasks_lib.text_windows(path, window=8, n_windows=1, tokenizer=_word_ids())
    with pytest.raises(ValueError, match=r"held-out part .* is empty: the file has 1 line"):
        tasks_lib.check_text_windows(one_line, window=8, n_windows=1)
    # before any tokenizer: fewer bytes than a window's tokens
    with pytest.raises(ValueError, match=r"only 42 bytes.*need at least 64 for one window"):
        tasks_lib.check_text_windows(short, window=64, n_windows=1)
    with pytest.raises(ValueError, match=r"only 420 bytes.*3 windows of 200 need 600"):
        tasks_lib.check_text_windows(short, window=200, n_windows=3, heldout_fraction=1.0)
    tasks_lib.check_text_windows(short, window=200, n_windows=2, heldout_fraction=1.0)  # may fit
    # with the tokenizer: the exact count
    with pytest.raises(ValueError, match=r"has only 9 tokens.*need at least 16 for one window"):
        tasks_lib.text_windows(short, window=16, n_windows=1, tokenizer=_word_ids())


def test_text_windows_default_is_tinyshakespeare_tail():
    windows = tasks_lib.text_windows(window=128, n_windows=4, tokenizer=_word_ids())
    assert windows.shape == (4, 128)
