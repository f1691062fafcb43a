"""``python -m jaxkv.eval``: the main job, run folders, and checking every argument before any
model loads or any file is written (issue 12's probe of bad inputs).

Most cases stop before a model would load: ``load_eval_model`` / ``jaxkv.load`` are replaced by
functions that fail the test if reached.
"""

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import jaxkv
from jaxkv.cli import eval as eval_lib
from jaxkv.cli import suite
from jaxkv.evals import fidelity, report, runner
from jaxkv.model import cache_kernel, loading
from jaxkv.policies import learned as learned_lib

TINY = ["--model", "tiny", "--min-budget", "8", "--batch", "2"]
WINDOWS = ["--window", "96", "--prompt-len", "64"]
SHIPPED = learned_lib.shipped_checkpoints() / "distillcache_smollm2_cpu"


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model load is reached (validation must come first)."""

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(runner, "load_eval_model", fail)
    monkeypatch.setattr(jaxkv, "load", fail)


def _suite(args, capsys):
    """(exit status, stderr) of a suite command; argparse's exits count as statuses."""
    try:
        status = eval_lib.main(args)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def _generate(args, capsys):
    try:
        status = eval_lib.main(["generate", "--prompt", "hi", *args])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def _old_results(out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"model": "earlier run", "complete": True, "records": [{"kl_mean": 0.1}]})
    (out / "fidelity.json").write_text(text)
    return text


# ----------------------------------------------------------------------------------------------
# 1. the main job


def test_main_job_default_includes_the_shipped_learned_policy_and_no_out():
    args = eval_lib.build_parser().parse_args(suite.DEFAULT_JOB)
    assert args.command == "fidelity" and args.model == "smollm2-135m"
    policies = args.policies.split(",")
    assert "learned:distillcache_smollm2_cpu" in policies
    assert {"full", "streaming_llm", "h2o", "snapkv", "tova"} <= set(policies)
    assert args.ratios == "0.25,0.125" and args.out is None


def test_learned_names_resolve_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("distillcache_smollm2_cpu", str(SHIPPED)):
        (group,) = runner.parse_policies(f"learned:{spec}")
        assert group.label == "learned:distillcache_smollm2_cpu" and len(group.members) == 1
        assert group.members[0].name == f"learned:{SHIPPED}"


@pytest.mark.parametrize("kind", ["learned", "ranker"])
def test_seed_globs_and_lists_are_relative_to_the_working_directory(kind, tmp_path, monkeypatch):
    shipped = SHIPPED if kind == "learned" else SHIPPED.parent / "ranker_smollm2_cpu"
    (tmp_path / "runs").mkdir()
    for name in ("seed0", "seed1"):
        (tmp_path / "runs" / name).symlink_to(shipped, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for spec in ("runs/seed*", "runs/seed0+runs/seed1"):
        (group,) = runner.parse_policies(f"{kind}:{spec}")
        assert group.label == f"{kind}:{spec}" and len(group.members) == 2
        assert [p.name for p in group.members] == [f"{kind}:runs/seed0", f"{kind}:runs/seed1"]
    groups = runner.parse_policies(f"{kind}:runs/seed*,{kind}:runs/seed0+runs/seed1")
    assert [len(g.members) for g in groups] == [2, 2]  # two seed groups in one run
    with pytest.raises(ValueError, match="'nothing/seed\\*' matches no checkpoint"):
        runner.parse_policies(f"{kind}:nothing/seed*")


def test_runs_without_out_go_to_a_fresh_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["fidelity", *TINY, *WINDOWS, "--limit", "2", "--ratios", "0.5"]
    args += ["--policies", "full,h2o", "--seeds", "0"]
    assert eval_lib.main(args) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("fidelity-") and len(run.name) == len("fidelity-20250101-120000")
    assert json.loads((run / "fidelity.json").read_text())["complete"] is True
    assert f"runs/{run.name}/" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
    assert suite.new_run_dir("fidelity") != run  # a second run of the same second gets another


# ----------------------------------------------------------------------------------------------
# 2. nothing is written before every argument is checked


@pytest.mark.parametrize(
    "bad",
    [
        ["--prompt-len", "500"],
        ["--prompt-len", "96"],
        ["--prompt-len", "-3"],
        ["--window", "0"],
        ["--ratios", "0.5,2"],
        ["--policies", "h2o,nope"],
        ["--text", "/nonexistent/text.txt"],
    ],
)
def test_a_failing_rerun_keeps_the_finished_results(bad, tmp_path, capsys, no_model):
    out = tmp_path / "results"
    old = _old_results(out)
    status, err = _suite(["fidelity", *TINY, *WINDOWS, *bad, "--out", str(out)], capsys)
    assert status == 2 and "error: " in err
    assert (out / "fidelity.json").read_text() == old
    assert sorted(p.name for p in out.iterdir()) == ["fidelity.json"]
    assert "kept in" not in err  # the earlier run's file is not this run's partial result


def test_result_store_replaces_old_results_only_at_its_first_save(tmp_path):
    old = _old_results(tmp_path)
    fresh = tmp_path / "new" / "deeper"
    kw = dict(model="tiny", config={}, summarize=lambda rs: rs, render=lambda rows: "table\n")
    store = report.ResultStore(tmp_path, "fidelity", **kw)
    report.ResultStore(fresh, "fidelity", **kw)
    assert (tmp_path / "fidelity.json").read_text() == old and not fresh.exists()
    store.add({"policy": "h2o"})
    doc = json.loads((tmp_path / "fidelity.json").read_text())
    assert doc["records"] == [{"policy": "h2o"}] and doc["complete"] is False


def test_out_must_be_a_folder(tmp_path, capsys, no_model):
    afile = tmp_path / "afile"
    afile.write_text("x")
    status, err = _suite(["fidelity", *TINY, "--out", str(afile)], capsys)
    assert status == 2 and "is a file, not a folder" in err
    status, err = _suite(["fidelity", *TINY, "--out", str(afile / "sub")], capsys)
    assert status == 2 and "is a file, not a folder" in err


# ----------------------------------------------------------------------------------------------
# 3. concurrent writers


def test_write_atomic_with_concurrent_writers_leaves_one_complete_version(tmp_path):
    path = tmp_path / "out" / "fidelity.json"
    versions = {f"{w}\n" * 100_000 for w in "ab"}
    errors, seen = [], set()
    stop = threading.Event()

    def write(text):
        try:
            for _ in range(30):
                report.write_atomic(path, text)
        except Exception as e:  # noqa: BLE001 - any failure is the test's finding
            errors.append(e)

    def read():
        while not stop.is_set():
            if path.exists():
                seen.add(path.read_text())

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(v,)) for v in versions]
    reader.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not errors
    assert path.read_text() in versions and seen <= versions
    assert os.listdir(path.parent) == ["fidelity.json"]  # no temporary file left behind
    assert (path.stat().st_mode & 0o777) == 0o644


# ----------------------------------------------------------------------------------------------
# 4. LongBench files


def _longbench_file(path: Path, *records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _lb_record(**changes):
    record = {"_id": "q0", "input": "Capital of France?", "context": "Paris is the capital."}
    return {**record, "answers": ["Paris"], "length": 5, "all_classes": None, **changes}


@pytest.mark.parametrize(
    "record, message",
    [
        (None, "hotpotqa.jsonl: no records"),
        (_lb_record(answers="Paris"), ":1: field 'answers' must be a non-empty list of strings"),
        (_lb_record(context=["Paris"]), ":1: field 'context' must be a string"),
        (_lb_record(length="5"), ":1: field 'length' must be an integer"),
    ],
)
def test_longbench_bad_or_empty_files_fail_before_the_model(record, message, tmp_path, capsys):
    path = tmp_path / "hotpotqa.jsonl"
    _longbench_file(path, *([record] if record else []))
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "load_eval_model", lambda *a, **k: pytest.fail("model loaded"))
        status, err = _suite(["longbench", *TINY, "--data", str(path), "--out", str(out)], capsys)
    assert status == 2 and message in err and not out.exists()


# ----------------------------------------------------------------------------------------------
# 5. generate


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--policy", "h2o", "--budget", "0"],
            "argument --budget: must be an integer >= 1, got '0'",
        ),
        (["--ratio", "0.5"], "--ratio needs --policy"),
        (["--budget", "64"], "--budget needs --policy"),
        (["--policy", "full", "--ratio", "0.5"], "--ratio needs --policy"),
        (["--ratio", "0.5", "--min-budget", "8"], "--ratio/--min-budget need --policy"),
        (["--policy", "h2o", "--ratio", "0.5", "--budget", "8"], "--ratio or --budget, not both"),
        (["--policy", "h2o", "--ratio", "0"], "argument --ratio: must be a number in (0, 1]"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
        (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be an integer >= 1"),
        (["--temperature", "-1"], "argument --temperature: must be a number in [0, inf)"),
        (["--temperature", "nan"], "argument --temperature: must be a number in [0, inf)"),
        (["--top-p", "0"], "argument --top-p: must be a number in (0, 1]"),
        (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1]"),
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 2147483647]"),
        (["--policy", "h2o", "--evict-every", "0"], "argument --evict-every: must be an integer"),
    ],
)
def test_generate_checks_its_flags_before_the_model_loads(args, message, capsys, no_model):
    status, err = _generate(args, capsys)
    assert status == 2 and message in err


def test_generate_compression_defaults():
    parse = lambda *a: eval_lib.build_parser().parse_args(["generate", "--prompt", "hi", *a])
    assert eval_lib.generate_compression(parse()) == {}
    assert eval_lib.generate_compression(parse("--policy", "full")) == {}
    comp = eval_lib.generate_compression(parse("--policy", "snapkv"))
    assert comp == {"policy": "snapkv", "ratio": 0.25, "budget": None}
    comp = eval_lib.generate_compression(parse("--policy", "h2o", "--budget", "64"))
    assert comp["ratio"] is None and comp["budget"] == 64


@pytest.mark.parametrize(
    "flags, n_prompts, out_first",
    [
        ([], 1, True),  # auto: one prompt decodes at batch 1, where out-first is faster
        ([], 2, False),
        (["--weight-layout", "canonical"], 1, False),
        (["--weight-layout", "out-first"], 2, True),
    ],
)
def test_generate_picks_the_weight_layout_by_batch(flags, n_prompts, out_first, monkeypatch):
    seen = {}

    def load(name, **kwargs):
        seen.update(kwargs)
        raise OSError("stop after the load")

    monkeypatch.setattr(jaxkv, "load", load)
    prompts = [a for i in range(n_prompts) for a in ("--prompt", f"p{i}")]
    assert eval_lib.main(["generate", *prompts, *flags]) == 2
    assert seen == {"dtype": "float32", "out_first": out_first, "attention": "xla", "matmul": "xla"}


@pytest.mark.parametrize("flag", ["attention", "matmul"])
def test_generate_passes_a_kernel_to_the_load(monkeypatch, flag):
    seen = {}

    def load(name, **kwargs):
        seen.update(kwargs)
        raise OSError("stop after the load")

    monkeypatch.setattr(jaxkv, "load", load)
    monkeypatch.setattr(cache_kernel, "available", lambda: True)
    argv = ["generate", "--prompt", "p", "--prompt", "q", f"--{flag}", "kernel"]
    assert eval_lib.main(argv) == 2
    assert seen[flag] == "kernel"


@pytest.mark.parametrize("flag", ["--attention", "--matmul"])
def test_generate_with_an_unavailable_kernel_fails_before_the_model(monkeypatch, capsys, flag):
    monkeypatch.setattr(cache_kernel, "_load", lambda: (False, "no C++ compiler"))
    monkeypatch.setattr(jaxkv, "load", lambda *a, **k: pytest.fail("loaded the model"))
    assert eval_lib.main(["generate", "--prompt", "p", flag, "kernel"]) == 2
    assert "no C++ compiler" in capsys.readouterr().err


def test_generate_matmul_kernel_with_canonical_weights_fails_before_the_model(monkeypatch, capsys):
    monkeypatch.setattr(cache_kernel, "available", lambda: True)
    monkeypatch.setattr(jaxkv, "load", lambda *a, **k: pytest.fail("loaded the model"))
    argv = ["generate", "--prompt", "p", "--matmul", "kernel", "--weight-layout", "canonical"]
    assert eval_lib.main(argv) == 2
    assert "drop --weight-layout canonical" in capsys.readouterr().err


def test_out_first_for_rejects_an_unknown_layout():
    with pytest.raises(ValueError, match="weight layout must be one of"):
        loading.out_first_for("rows-first", batch_size=1)


# ----------------------------------------------------------------------------------------------
# 6. fidelity --text


def test_fidelity_text_that_is_binary_or_too_short_fails_before_the_model(
    tmp_path, capsys, no_model
):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    one_line = tmp_path / "one.txt"
    one_line.write_text("To be, or not to be, that is the question. " * 5)
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.\n" * 20)
    cases = [
        ([binary], f"{binary} is not UTF-8 text"),
        ([one_line], "the held-out part (the last 10% of the file, from a line start) is empty"),
        ([one_line, "--heldout", "1"], "need at least 384 for one window"),
        ([short, "--heldout", "1"], f"{short} has only 420 bytes, so at most 420 tokens"),
    ]
    for text, message in cases:
        status, err = _suite(["fidelity", *TINY, "--text", *map(str, text)], capsys)
        assert status == 2 and message in err, err


def test_fidelity_offset_reads_the_windows_after_the_first(tmp_path, monkeypatch):
    """--offset k·window --limit n scores windows k..k+n-1 of the run without it (the unread
    windows of a held-out part), and the result file records the offset."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i} of a text to cut into windows\n" for i in range(400)))
    seen = []

    def record(model, groups, *, windows_NT, **kw):
        seen.append(windows_NT)
        return run(model, groups, windows_NT=windows_NT, **kw)

    run = fidelity.run
    monkeypatch.setattr(fidelity, "run", record)
    base = ["fidelity", *TINY, *WINDOWS, "--text", str(text), "--heldout", "1"]
    base += ["--ratios", "0.5", "--policies", "full,h2o", "--seeds", "0"]
    assert eval_lib.main([*base, "--limit", "3", "--out", str(tmp_path / "a")]) == 0
    after = ["--limit", "2", "--offset", "96", "--out", str(tmp_path / "b")]
    assert eval_lib.main([*base, *after]) == 0
    np.testing.assert_array_equal(seen[1], seen[0][1:])
    config = json.loads((tmp_path / "b" / "fidelity.json").read_text())["config"]
    assert config["offset"] == 96 and config["windows"] == 2
    assert "offset" not in json.loads((tmp_path / "a" / "fidelity.json").read_text())["config"]


def test_fidelity_offset_past_the_text_fails_before_the_model(tmp_path, capsys, no_model):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.\n" * 40)  # 840 bytes
    args = ["fidelity", *TINY, "--text", str(short), "--heldout", "1", "--limit", "2"]
    status, err = _suite([*args, "--offset", "100"], capsys)
    assert status == 2 and "2 windows of 384 after offset 100 need 868" in err, err
    status, err = _suite([*args, "--offset", "-1"], capsys)
    assert status == 2 and "argument --offset: must be an integer >= 0" in err, err


def test_fidelity_records_kvzips_request_when_a_policy_reads_its_reconstruction(tmp_path):
    base = ["fidelity", *TINY, *WINDOWS, "--limit", "1", "--ratios", "0.5", "--seeds", "0"]
    base += ["--protocol", "prefill"]

    def config(name, *flags):
        assert eval_lib.main([*base, *flags, "--out", str(tmp_path / name)]) == 0
        return json.loads((tmp_path / name / "fidelity.json").read_text())["config"]

    assert config("h2o", "--policies", "h2o").get("kvzip_request") is None
    assert config("plain", "--policies", "kvzip")["kvzip_request"] == "plain"
    assert (
        config("chat", "--policies", "h2o,kvzip", "--kvzip-request", "chat")["kvzip_request"]
        == "chat"
    )


def test_fidelity_unknown_kvzip_request_fails_before_the_model(tmp_path, capsys, no_model):
    args = ["fidelity", *TINY, "--protocol", "prefill", "--policies", "kvzip"]
    status, err = _suite([*args, "--kvzip-request", "json", "--out", str(tmp_path / "x")], capsys)
    assert status == 2 and "argument --kvzip-request: invalid choice: 'json'" in err, err
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------
# 7. numeric flags of every subcommand


@pytest.mark.parametrize(
    "args, message",
    [
        (["fidelity", "--limit", "0"], "argument --limit: must be an integer >= 1, got '0'"),
        (["fidelity", "--batch", "0"], "argument --batch: must be an integer >= 1, got '0'"),
        (["fidelity", "--window", "1"], "argument --window: must be an integer >= 2"),
        (["fidelity", "--window", "abc"], "argument --window: must be an integer >= 2"),
        (["fidelity", "--heldout", "0"], "argument --heldout: must be a number in (0, 1]"),
        (["fidelity", "--heldout", "1.5"], "argument --heldout: must be a number in (0, 1]"),
        (["fidelity", "--min-budget", "0"], "argument --min-budget: must be an integer >= 1"),
        (["fidelity", "--ratios", "0"], "--ratios must lie in (0, 1]"),
        (["fidelity", "--ratios", "0.5,nan"], "--ratios must lie in (0, 1]"),
        (["fidelity", "--ratios", ","], "--ratios: empty list"),
        (["fidelity", "--seeds", "-1"], "--seeds must lie in [0, 2**31)"),
        (["fidelity", "--seeds", "0,0"], "--seeds names a seed twice"),
        (["fidelity", "--seeds", "a"], "--seeds: cannot parse"),
        (["positions", "--prompt-len", "512"], "--prompt-len must be in [1, 511]"),
        (["positions", "--policies", "full"], "at least one evicting policy"),
        (["retrieval", "--lengths", "0"], "--lengths must be >= 128"),
        (["retrieval", "--data-seed", "-1"], "argument --data-seed: must be an integer in"),
        (["gsm8k", "--shots", "9"], "argument --shots: must be an integer in [0, 8]"),
        (["gsm8k", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer"),
        (["bbh", "--tasks", ","], "--tasks: empty list"),
        (["longbench", "--data", "x.jsonl", "--max-length", "0"], "argument --max-length"),
        (["agreement", "--policies", "full"], "at least one evicting policy"),
        (["agreement", "--data", "x.jsonl"], "--data is only read with --task longbench"),
        (["latency", "--context", "0"], "argument --context: must be an integer >= 1"),
        (["latency", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
        (["longbench"], "one of the arguments --data --hub is required"),
        (["longbench", "--hub", "x"], "--hub needs --dataset NAME"),
        (["longbench", "--data", "x", "--hub", "y"], "argument --hub: not allowed with"),
        (["fidelity", "--wikitext-split", "test"], "--wikitext-split needs --wikitext"),
        (["fidelity", "--text", "a", "--wikitext", "b"], "argument --wikitext: not allowed with"),
    ],
)
def test_numeric_flags_are_checked(args, message, tmp_path, capsys, no_model):
    out = tmp_path / "out"
    status, err = _suite([*args, "--model", "tiny", "--out", str(out)], capsys)
    assert status == 2 and message in err, err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 8. bad learned checkpoints


def _bad_policy_dirs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    afile = tmp_path / "policy.txt"
    afile.write_text("not a policy")
    half = tmp_path / "half"
    half.mkdir()
    (half / "policy.json").write_text(json.dumps({"kind": "distillcache-policy", "hidden": 128}))
    junk = tmp_path / "junk"
    (junk / "params").mkdir(parents=True)
    (junk / "policy.json").write_text((SHIPPED / "policy.json").read_text())
    (junk / "params" / "manifest.ocdbt").write_bytes(b"\x00garbage")
    return {
        "missing": (tmp_path / "nope", "nope: no such directory"),
        "missing name": (Path("no_such_policy"), "no such folder, and no shipped checkpoint"),
        "not a policy": (empty, "empty_dir: missing policy.json"),
        "a file": (afile, "policy.txt: not a directory"),
        "no params": (half, "half: policy.json records no checksum"),
        "junk params": (junk, "junk: missing file params/"),
    }


def test_bad_learned_paths_are_one_line_errors(tmp_path, capsys, no_model):
    for path, message in _bad_policy_dirs(tmp_path).values():
        for status, err in (
            _suite(["fidelity", *TINY, "--policies", f"h2o,learned:{path}"], capsys),
            _generate(["--policy", f"learned:{path}"], capsys),
        ):
            assert status == 2, err
            assert err.startswith("error: ") and err.count("\n") == 1, err
            assert message in err and "Traceback" not in err
    status, err = _suite(["fidelity", *TINY, "--policies", "learned:"], capsys)
    assert status == 2 and "learned: needs a checkpoint folder" in err
