"""The ``datasets`` loaders of the full public sets, offline on small files in the hub's layout.

Each test writes the same rows twice, in the hub's layout and in the shipped one, and checks
that ``hub`` builds exactly the Examples that ``tasks`` builds. Tests that need ``datasets``
take the ``hf`` fixture and are skipped without it; the missing-extra tests always run. The
last section runs ``python -m jaxkv.eval`` with ``--hub`` / ``--wikitext`` end to end on the
tiny model.
"""

import json
import os
import shutil
import sys

import pytest

from jaxkv import data as data_lib
from jaxkv.cli import eval as eval_lib
from jaxkv.evals import hub as hub_lib
from jaxkv.evals import runner
from jaxkv.evals import tasks as tasks_lib

# Before ``datasets`` is imported: it reads these once. The tests never reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SHIPPED = data_lib.shipped_data_dir()
GSM8K_EXEMPLARS = "gsm8k/lm_eval_harness/gsm8k_cot_8shot_exemplars.json"
BBH_TASKS = ("date_understanding", "boolean_expressions")


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """The ``datasets`` module (the test is skipped without it), caching under ``tmp_path``."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return datasets


def _parquet(path, rows):
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {key: [row.get(key) for row in rows] for key in rows[0]}
    datasets.Dataset.from_dict(columns).to_parquet(str(path))


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _copy_shipped(data_dir, relative):
    (data_dir / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHIPPED / relative, data_dir / relative)


def _shipped_rows(relative, n):
    lines = (SHIPPED / relative).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:n]]


def _word_ids():
    vocab = {}
    return lambda text: [vocab.setdefault(w, len(vocab)) for w in text.split()]


# ---- GSM8K ---------------------------------------------------------------------------------------


@pytest.fixture
def gsm8k_rows():
    return {
        "test": _shipped_rows("gsm8k/test.jsonl", 5),
        "train": _shipped_rows("gsm8k/train.jsonl", 3),
    }


@pytest.fixture
def gsm8k_dirs(hf, tmp_path, gsm8k_rows):
    """(hub folder, shipped-layout data folder) holding the same rows."""
    hub_dir, data_dir = tmp_path / "openai-gsm8k", tmp_path / "data"
    _copy_shipped(data_dir, GSM8K_EXEMPLARS)
    for split, rows in gsm8k_rows.items():
        _parquet(hub_dir / "main" / f"{split}-00000-of-00001.parquet", rows)
        _jsonl(data_dir / "gsm8k" / f"{split}.jsonl", rows)
    return hub_dir, data_dir


@pytest.mark.parametrize("split", ["test", "train"])
def test_gsm8k_from_hub_layout_equals_shipped_loader(gsm8k_dirs, gsm8k_rows, split):
    hub_dir, data_dir = gsm8k_dirs
    got = hub_lib.gsm8k_examples(hub_dir, split, data_dir=data_dir)
    assert got == tasks_lib.gsm8k_examples(split, data_dir=data_dir)
    assert len(got) == len(gsm8k_rows[split])
    assert got[0].id == f"gsm8k-{split}-0"
    assert got[0].prompt.endswith(f"Q: {gsm8k_rows[split][0]['question']}\nA:")


def test_gsm8k_limit_shots_and_single_file(gsm8k_dirs):
    hub_dir, data_dir = gsm8k_dirs
    want = tasks_lib.gsm8k_examples("test", n_shot=3, limit=2, data_dir=data_dir)
    assert hub_lib.gsm8k_examples(hub_dir, n_shot=3, limit=2, data_dir=data_dir) == want
    one_file = hub_dir / "main" / "test-00000-of-00001.parquet"
    assert hub_lib.gsm8k_examples(one_file, n_shot=3, limit=2, data_dir=data_dir) == want
    assert hub_lib.gsm8k_examples(hub_dir, limit=0, data_dir=data_dir) == []
    with pytest.raises(ValueError, match="limit must be >= 0"):
        hub_lib.gsm8k_examples(hub_dir, limit=-1, data_dir=data_dir)
    with pytest.raises(ValueError, match="unknown GSM8K split 'validation'"):
        hub_lib.gsm8k_examples(hub_dir, "validation", data_dir=data_dir)


def test_hub_name_goes_through_load_dataset(hf, gsm8k_rows, monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        rows = gsm8k_rows[kwargs["split"]]
        return hf.Dataset.from_dict({k: [r[k] for r in rows] for k in ("question", "answer")})

    monkeypatch.setattr(hf, "load_dataset", fake_load_dataset)
    got = hub_lib.gsm8k_examples(limit=2, data_dir=SHIPPED)
    assert calls == [("openai/gsm8k", "main", {"split": "test"})]
    assert got == tasks_lib.gsm8k_examples(limit=2, data_dir=SHIPPED)  # same first rows


def test_uncached_hub_name_is_a_clear_error_offline(hf):
    if not hf.config.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1 (the test must not reach the hub)")
    with pytest.raises(FileNotFoundError, match="'jaxkv-tests/no-such-set' is not a local path"):
        hub_lib.gsm8k_examples("jaxkv-tests/no-such-set")


def test_missing_split_lists_the_layouts_tried(hf, tmp_path):
    (tmp_path / "main").mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"no 'main' 'test' files in .*main/test-\*\.parquet"
    ):
        hub_lib.gsm8k_examples(tmp_path)


def test_missing_column_and_unknown_file_type(hf, tmp_path):
    _parquet(tmp_path / "main" / "test-00000-of-00001.parquet", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"main/test\]: missing column\(s\) \['answer'\]"):
        hub_lib.gsm8k_examples(tmp_path)
    (tmp_path / "rows.csv").write_text("question,answer\nq,#### 1\n")
    with pytest.raises(ValueError, match="rows.csv: unknown file type"):
        hub_lib.gsm8k_examples(tmp_path / "rows.csv")


# ---- BBH -----------------------------------------------------------------------------------------


def test_bbh_from_hub_layout_equals_shipped_loader(hf, tmp_path):
    hub_dir, data_dir = tmp_path / "lukaemon-bbh", tmp_path / "data"
    for task in BBH_TASKS:
        rows = json.loads((SHIPPED / "bbh" / "bbh" / f"{task}.json").read_text())["examples"][:4]
        _parquet(hub_dir / task / "test-00000-of-00001.parquet", rows)
        (data_dir / "bbh" / "bbh").mkdir(parents=True, exist_ok=True)
        (data_dir / "bbh" / "bbh" / f"{task}.json").write_text(json.dumps({"examples": rows}))
        _copy_shipped(data_dir, f"bbh/cot-prompts/{task}.txt")
    for task in BBH_TASKS:
        got = hub_lib.bbh_examples(task, hub_dir, data_dir=data_dir)
        assert got == tasks_lib.bbh_examples(task, data_dir=data_dir)
        assert [e.id for e in got] == [f"bbh/{task}-{i}" for i in range(4)]
        assert hub_lib.bbh_examples(task, hub_dir, limit=1, data_dir=data_dir) == got[:1]
    with pytest.raises(ValueError, match="unknown BBH task 'nosuch'; valid tasks: boolean_expr"):
        hub_lib.bbh_examples("nosuch", hub_dir, data_dir=data_dir)


# ---- LongBench -----------------------------------------------------------------------------------


def _longbench_rows(dataset):
    """LongBench rows with every field of the hub's schema (``trec``'s without ``_id``)."""
    if dataset == "trec":
        classes = ["Abbreviation", "Entity", "Human being", "Location"]
        return [
            {
                "input": f"Who wrote question {i}?",
                "context": "Question: What is NASA?\nType: Abbreviation\n",
                "answers": [classes[i % 4]],
                "length": 20 + i,
                "dataset": "trec",
                "language": "en",
                "all_classes": classes,
            }
            for i in range(3)
        ]
    return [
        {
            "input": f"Which {dataset} question {i}?",
            "context": f"Passage {i}: Ada Lovelace wrote the first program.",
            "answers": ["Ada Lovelace", "Lovelace"][: 1 + i % 2],
            "length": 100 + i,
            "dataset": dataset.removesuffix("_e"),
            "language": "en",
            "all_classes": None,
            "_id": f"{dataset}-id-{i}",
        }
        for i in range(3)
    ]


@pytest.mark.parametrize("layout", ["data/{d}.jsonl", "{d}/test/0000.parquet"])
@pytest.mark.parametrize("dataset", ["hotpotqa", "hotpotqa_e", "trec"])
def test_longbench_from_hub_layout_equals_shipped_loader(hf, tmp_path, layout, dataset):
    rows = _longbench_rows(dataset)
    hub_file = tmp_path / "hub" / layout.format(d=dataset)
    if hub_file.suffix == ".jsonl":
        _jsonl(hub_file, rows)
    else:
        _parquet(hub_file, rows)
    jsonl = tmp_path / f"{dataset}.jsonl"
    _jsonl(jsonl, rows)
    got = hub_lib.longbench_examples(dataset, tmp_path / "hub")
    assert got == tasks_lib.longbench_examples(jsonl)
    assert got[0].meta["dataset"] == dataset.removesuffix("_e")
    assert hub_lib.longbench_examples(dataset, tmp_path / "hub", limit=2) == got[:2]


def test_longbench_bad_row_and_unsupported_dataset(hf, tmp_path):
    rows = _longbench_rows("hotpotqa")
    rows[1]["answers"] = []
    _jsonl(tmp_path / "hotpotqa.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"\[hotpotqa/test\]:2: field 'answers' must be a non-empty"
    ):
        hub_lib.longbench_examples("hotpotqa", tmp_path)
    with pytest.raises(ValueError, match="'dureader' uses 'rouge_zh_score'"):
        hub_lib.longbench_examples("dureader", tmp_path)
    with pytest.raises(ValueError, match="unknown LongBench dataset 'nosuch'"):
        hub_lib.longbench_examples("nosuch", tmp_path)


# ---- WikiText ------------------------------------------------------------------------------------

WIKI_RAW = (
    " \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 is a tactical game . \n"
    " It was released in January 2011 in Japan . \n \n = = Gameplay = = \n \n"
    " As with previous games , the player controls a squad . \n"
)


@pytest.mark.parametrize("config", ["wikitext-103-raw-v1", "wikitext-2-raw-v1"])
def test_wikitext_text_gives_the_raw_files_windows(hf, tmp_path, config):
    lines = WIKI_RAW.splitlines(keepends=True)
    rows = [{"text": line if line.strip() else ""} for line in lines]  # the hub's rows
    _parquet(tmp_path / "wikitext" / config / "test-00000-of-00001.parquet", rows)
    text = hub_lib.wikitext_text(tmp_path / "wikitext", config=config)
    assert text == "".join(line if line.strip() else "\n" for line in lines)
    raw_file, text_file = tmp_path / "wiki.test.raw", tmp_path / "wiki.test.txt"
    raw_file.write_text(WIKI_RAW, encoding="utf-8")
    text_file.write_text(text, encoding="utf-8")
    kwargs = dict(window=5, n_windows=6, heldout_fraction=1.0)
    want = tasks_lib.text_windows(raw_file, tokenizer=_word_ids(), **kwargs)
    assert (tasks_lib.text_windows(text_file, tokenizer=_word_ids(), **kwargs) == want).all()


def test_wikitext_blank_text_is_an_error(hf, tmp_path):
    _parquet(tmp_path / "wikitext-103-raw-v1" / "test-00000-of-00001.parquet", [{"text": ""}] * 3)
    with pytest.raises(ValueError, match=r"wikitext-103-raw-v1/test\]: the text is empty"):
        hub_lib.wikitext_text(tmp_path)


# ---- without the extra ---------------------------------------------------------------------------


def test_missing_extra_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    message = "the hub loaders need the optional extra: pip install 'jaxkv[hf]'"
    calls = [
        lambda: hub_lib.gsm8k_examples(tmp_path),
        lambda: hub_lib.bbh_examples("date_understanding", tmp_path),
        lambda: hub_lib.longbench_examples("hotpotqa", tmp_path),
        lambda: hub_lib.wikitext_text(tmp_path),
    ]
    for call in calls:
        with pytest.raises(ImportError) as info:
            call()
        assert str(info.value) == message


# ---- the command line ----------------------------------------------------------------------------

TINY = ["--model", "tiny", "--min-budget", "8", "--batch", "2", "--seeds", "0"]
GEN = [*TINY, "--policies", "full,h2o", "--ratios", "0.5", "--limit", "2", "--max-new-tokens", "8"]


def _cli(args, out):
    """(exit status, the result file) of ``python -m jaxkv.eval ARGS --out OUT``."""
    status = eval_lib.main([*args, "--out", str(out)])
    name = args[0]
    path = out / f"{name}.json"
    return status, json.loads(path.read_text()) if path.exists() else None


def test_cli_gsm8k_from_the_hub_layout(gsm8k_dirs, gsm8k_rows, tmp_path):
    hub_dir, _ = gsm8k_dirs
    status, doc = _cli(["gsm8k", *GEN, "--shots", "1", "--hub", str(hub_dir)], tmp_path / "out")
    assert status == 0 and doc["complete"] is True
    assert doc["config"]["hub"] == str(hub_dir) and doc["config"]["shots"] == 1
    full = [r for r in doc["records"] if r["policy"] == "full"]
    want = tasks_lib.gsm8k_examples(n_shot=1, limit=2, data_dir=SHIPPED)
    assert [(r["id"], r["target"]) for r in full] == [(e.id, e.target) for e in want]


def test_cli_bbh_from_the_hub_layout(hf, tmp_path):
    task = "date_understanding"
    rows = json.loads((SHIPPED / "bbh" / "bbh" / f"{task}.json").read_text())["examples"][:3]
    _parquet(tmp_path / "bbh" / task / "test-00000-of-00001.parquet", rows)
    status, doc = _cli(["bbh", *GEN, "--tasks", task, "--hub", str(tmp_path / "bbh")], tmp_path)
    assert status == 0 and doc["config"]["hub"] == str(tmp_path / "bbh")
    assert {r["id"] for r in doc["records"]} == {f"bbh/{task}-0", f"bbh/{task}-1"}


def test_cli_longbench_from_the_hub_layout(hf, tmp_path):
    _parquet(tmp_path / "hub" / "hotpotqa" / "test" / "0000.parquet", _longbench_rows("hotpotqa"))
    args = ["longbench", *GEN, "--hub", str(tmp_path / "hub"), "--dataset", "hotpotqa"]
    status, doc = _cli(args, tmp_path / "out")
    assert status == 0
    assert doc["config"]["hub"] == str(tmp_path / "hub")
    assert doc["config"]["dataset"] == "hotpotqa" and "data" not in doc["config"]
    assert {r["id"] for r in doc["records"]} == {"hotpotqa-id-0", "hotpotqa-id-1"}


def test_cli_fidelity_on_wikitext(hf, tmp_path):
    rows = [{"text": f" = Section {i} = \n"} for i in range(4)]
    rows += [{"text": f" Line {i} of the article , about {i} things . \n"} for i in range(20)]
    _parquet(tmp_path / "wiki" / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet", rows)
    args = ["fidelity", *TINY, "--window", "96", "--prompt-len", "64", "--limit", "2"]
    args += ["--policies", "full,h2o", "--ratios", "0.5"]
    args += ["--wikitext", str(tmp_path / "wiki"), "--wikitext-config", "wikitext-2-raw-v1"]
    status, doc = _cli(args, tmp_path / "out")
    assert status == 0
    config = doc["config"]
    assert config["text"] == f"{tmp_path / 'wiki'} [wikitext-2-raw-v1/test]"
    assert config["heldout"] == 1.0 and config["windows"] == 2


@pytest.mark.parametrize(
    "args",
    [
        ["gsm8k", "--hub", "openai/gsm8k"],
        ["bbh", "--hub", "lukaemon/bbh"],
        ["longbench", "--hub", "THUDM/LongBench", "--dataset", "hotpotqa"],
        ["fidelity", "--wikitext", "Salesforce/wikitext"],
    ],
)
def test_cli_without_the_extra_is_a_one_line_error(args, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(runner, "load_eval_model", lambda *a, **k: pytest.fail("model loaded"))
    status, doc = _cli([*args, "--model", "tiny"], tmp_path / "out")
    err = capsys.readouterr().err
    assert status == 2 and doc is None
    assert err == "error: the hub loaders need the optional extra: pip install 'jaxkv[hf]'\n"
