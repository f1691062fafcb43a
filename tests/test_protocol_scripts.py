"""The held-out protocols' selection rule and table (``scripts/distillcache_decode_select.py``,
``scripts/distillcache_confirm_report.py``) on hand-made result files: the rule's bounds decide
as PROTOCOL.md says, and a report restricted to the runs a protocol planned names no others."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BASE = "ranker:ranker_recall_tier_smollm2_cpu"


def _fidelity(path: Path, kl: dict, *, per_window: int = 0) -> None:
    """A finished fidelity.json with ``kl[(policy, ratio)]`` as each row's mean KL."""
    path.mkdir(parents=True)
    results = [{"policy": p, "ratio": r, "kl_mean": v} for (p, r), v in kl.items()]
    records = [
        {"policy": p, "ratio": r, "kl_per_window": [v] * per_window} for (p, r), v in kl.items()
    ]
    doc = {"complete": True, "results": results, "records": records}
    (path / "fidelity.json").write_text(json.dumps(doc))


def _select(
    tmp_path: Path, ratios: dict, *, checkpoints: bool = True, base: str | None = None
) -> tuple[str, Path]:
    """Runs the rule on 4 domains where candidate c has KL ``ratios[c][r]`` × the base's (each
    with a checkpoint to ship, or a policy name only); ``base`` is passed as ``--base``, and the
    default base then gets the KL that would make every candidate ship."""
    for domain in ("chat", "code", "math", "prose"):
        kl = {(base or BASE, r): 1.0 for r in (0.25, 0.125)}
        if base:
            kl |= {(BASE, r): 10.0 for r in (0.25, 0.125)}
        kl |= {(c, r): x for c, by in ratios.items() for r, x in by.items()}
        _fidelity(tmp_path / f"check_{domain}", kl)
    for c in ratios:
        (tmp_path / c).mkdir()
        (tmp_path / c / "ranker.json").write_text("{}")
    shipped = tmp_path / "shipped"
    args = [f"{c}={tmp_path / c}" if checkpoints else c for c in ratios]
    ship = ["--ship", shipped] if checkpoints else []
    cmd = [sys.executable, SCRIPTS / "distillcache_decode_select.py", tmp_path, *args, *ship]
    cmd += ["--base", base, "--protocol", "prefill"] if base else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return out.split("Verdict: ", 1)[1], shipped


@pytest.mark.parametrize(
    ("ratios", "winner"),
    [
        # b is lowest at r = 0.125 but loses 3 % at r = 0.25: not admissible, a wins
        ({"a": {0.25: 1.0, 0.125: 0.95}, "b": {0.25: 1.03, 0.125: 0.90}}, "a"),
        # the best admissible gains only 2 % at r = 0.125: nothing ships
        ({"a": {0.25: 0.9, 0.125: 0.98}, "b": {0.25: 1.0, 0.125: 0.99}}, None),
        ({"a": {0.25: 1.05, 0.125: 0.5}}, None),  # none admissible
    ],
)
@pytest.mark.parametrize("checkpoints", [True, False])
def test_decode_rule(tmp_path, ratios, winner, checkpoints):
    verdict, shipped = _select(tmp_path, ratios, checkpoints=checkpoints)
    if winner is None:
        assert "nothing ships" in verdict
    else:
        assert verdict.startswith(f"`{winner}` wins and ships")
    assert (shipped / "ranker.json").exists() == (checkpoints and winner is not None)


def test_rule_against_another_base(tmp_path):
    # b beats the default base by far, but not rerank@0.5:x, the base the protocol names
    ratios = {"b": {0.25: 1.0, 0.125: 0.98}}
    verdict, _ = _select(tmp_path, ratios, checkpoints=False, base="rerank@0.5:x")
    assert "nothing ships" in verdict
    assert "prefill protocol" in (tmp_path / "select.md").read_text()


def test_report_names_only_the_planned_runs(tmp_path):
    kl = {("ranker:x", 0.25): 0.4, ("ranker:x", 0.125): 0.8}
    _fidelity(tmp_path / "decode_global", kl, per_window=2)
    heur = {("critical:h2o", 0.25): 0.5, ("critical:h2o", 0.125): 0.8}
    _fidelity(tmp_path / "decode_head", heur, per_window=2)
    report = SCRIPTS / "distillcache_confirm_report.py"
    runs = "decode_global,decode_head,decode_layer"
    cmd = [sys.executable, report, tmp_path, "--runs", runs]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "**0.4000** (0.80×, 2/2)" in text and "**0.8000** (1.00×, 0/2)" in text
    assert text.strip().endswith("Runs not (yet) complete: decode_layer.")


def test_report_joins_one_run_per_ratio_into_its_granularity(tmp_path):
    for r, (learned, heur) in {0.25: (0.4, 0.5), 0.125: (0.6, 0.8)}.items():
        _fidelity(tmp_path / f"decode_global-r{r}", {("ranker:x", r): learned}, per_window=2)
        _fidelity(tmp_path / f"decode_head-r{r}", {("h2o", r): heur}, per_window=2)
    runs = ",".join(f"decode_{g}-r{r}" for g in ("global", "head") for r in (0.25, 0.125))
    cmd = [sys.executable, SCRIPTS / "distillcache_confirm_report.py", tmp_path, "--runs", runs]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "| **ranker:x** | global | **0.4000** (0.80×, 2/2) | **0.6000** (0.75×, 2/2) |" in text
    assert "| h2o | head |" in text and "not (yet) complete" not in text


@pytest.mark.parametrize("mix", ["blend@0.25", "tier@0.05"])
def test_a_blend_with_a_ranker_is_learned_and_one_of_heuristics_is_not(tmp_path, mix):
    blend = f"{mix}:ranker:x+critical:h2o"
    kl = {(blend, 0.25): 0.3, (blend, 0.125): 0.6, ("blend@0.5:h2o+tova", 0.25): 0.45,
          ("blend@0.5:h2o+tova", 0.125): 0.75}  # fmt: skip
    _fidelity(tmp_path / "decode_global", kl, per_window=2)
    heur = {("critical:h2o", 0.25): 0.5, ("critical:h2o", 0.125): 0.8}
    _fidelity(tmp_path / "decode_head", heur, per_window=2)
    report = SCRIPTS / "distillcache_confirm_report.py"
    cmd = [sys.executable, report, tmp_path, "--runs", "decode_global,decode_head"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "**0.3000** (0.67×, 2/2)" in text and "**0.6000** (0.80×, 2/2)" in text


def test_report_pools_folders_and_gives_the_verdict(tmp_path):
    """Pooled over two parts of 2 windows, the learned row is 0.65 against kvzip's 0.75 (0.867×:
    not met at 0.85, though part a alone is 0.80×); kvpress's means are averaged, and a part
    without kvpress leaves that comparison unmeasured."""
    for part, (learned, kvzip, press) in {"a": (0.4, 0.5, 0.6), "b": (0.9, 1.0, 1.2)}.items():
        kl = {(p, r): v for p, v in (("rerank@0.5:ranker:x", learned), ("kvzip", kvzip))
              for r in (0.25, 0.125)}  # fmt: skip
        _fidelity(tmp_path / part / "prefill_global_nocap", kl, per_window=2)
        rows = [{"method": "KVzipPress", "ratio": r, "kl_mean": press} for r in (0.25, 0.125)]
        (tmp_path / part / "kvpress.json").write_text(json.dumps({"rows": rows}))
    report = [sys.executable, SCRIPTS / "distillcache_confirm_report.py", "--goal", "0.85"]
    parts = [tmp_path / "a", tmp_path / "b", "--runs", "prefill_global_nocap"]
    cmd = [*report, *parts, "--out", tmp_path / "pooled.md"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "over the 4 windows" in text and "**0.6500** (0.87×, 4/4; 0.72× kvpress)" in text
    assert "r = 0.125: 0.6500: 0.867× kvzip (global, no floor or cap), 0.722× kvpress" in text
    assert text.count("**not met**") == 2 and (tmp_path / "pooled.md").read_text() == text
    one = subprocess.run([*report, *parts[:1], *parts[2:]], capture_output=True, text=True)
    assert one.stdout.count("**met**") == 2  # part a alone: 0.80× and 0.67×
    (tmp_path / "b" / "kvpress.json").unlink()
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "kvpress not measured" in text and "not (yet) complete: kvpress" in text
    bad = subprocess.run([*report, *parts], capture_output=True, text=True)
    assert bad.returncode == 2 and "--out: needed with several folders" in bad.stderr


def _retrieval(path: Path, acc: dict) -> Path:
    """A finished retrieval.json with ``acc[policy][task]`` as each r = 0.25 row's accuracy."""
    path.mkdir(parents=True)
    results = [
        {"policy": p, "task": t, "ratio": 0.25, "score": s}
        for p, by in acc.items()
        for t, s in by.items()
    ]
    (path / "retrieval.json").write_text(json.dumps({"complete": True, "results": results}))
    return path / "retrieval.json"


TASKS = ("needle/1024", "needle/2048", "passkey/1024", "passkey/2048")


@pytest.mark.parametrize(
    ("kl", "acc", "chosen"),
    [
        # c has the most retrieval but 1.2× the base's KL at r = 0.125: b (admissible) is chosen
        (
            {"b": (1.1, 1.15), "c": (1.0, 1.2)},
            {"b": (25, 25, 75, 75), "c": (50, 50, 100, 100)},
            "b",
        ),
        # tie on the mean: the lower KL at r = 0.125 wins
        ({"b": (1.0, 1.1), "c": (1.0, 1.05)}, {"b": (25, 25, 75, 75), "c": (25, 50, 50, 75)}, "c"),
        # the best admissible is below TOVA per head in one cell: nothing is chosen
        ({"b": (1.0, 1.0)}, {"b": (100, 100, 100, 25)}, None),
    ],
)
def test_peak_tova_rule(tmp_path, kl, acc, chosen):
    base = "ranker:peak"
    for domain in ("chat", "code", "math", "prose"):
        rows = {(base, r): 1.0 for r in (0.25, 0.125)}
        rows |= {(c, r): x for c, xs in kl.items() for r, x in zip((0.25, 0.125), xs, strict=True)}
        _fidelity(tmp_path / f"check_{domain}", rows)
    _retrieval(
        tmp_path / "retrieval_global", {c: dict(zip(TASKS, a, strict=True)) for c, a in acc.items()}
    )
    tova = _retrieval(
        tmp_path / "tova_head", {"tova": dict(zip(TASKS, (0, 0, 50, 50), strict=True))}
    )
    cmd = [sys.executable, SCRIPTS / "distillcache_peak_tova_select.py", tmp_path, *kl]
    cmd += ["--base", base, "--tova-head", tova]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    chosen_file = tmp_path / "chosen.txt"
    if chosen is None:
        assert "nothing chosen" in out and not chosen_file.exists()
    else:
        assert f"chosen: `{chosen}`" in out and chosen_file.read_text().strip() == chosen


def _pooled_round(path: Path, correct: dict) -> None:
    """One round's two finished retrieval runs, 16 prompts per cell: ``correct[(policy,
    granularity)]`` the count per cell (TASKS order); every other run of the rule gets 0."""
    runs = [("blend@0.75:ranker:ranker_peak_tier_smollm2_cpu+tova", "global")]
    runs += [(h, "global") for h in ("h2o", "critical:h2o", "tova")]
    runs += [(h, "head") for h in ("tova", "h2o", "critical:h2o", "snapkv")]
    for gran in ("global", "head"):
        results = [
            {"policy": p, "task": t, "ratio": 0.25, "score": 100 * c / 16, "n_examples": 16}
            for p, g in runs
            if g == gran
            for t, c in zip(TASKS, correct.get((p, g), (0, 0, 0, 0)), strict=True)
        ]
        (path / f"retrieval_{gran}").mkdir(parents=True)
        doc = {"complete": True, "results": results}
        (path / f"retrieval_{gran}" / "retrieval.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("rounds", "verdict"),
    [
        # tova per head leads passkey in round 1, h2o in round 2; pooled, each has 20 and the
        # blend's 20 ties the best heuristic (a sum of per-round bests, 32, would fail it)
        (
            [{"h": (1, 1, 16, 4), "t": (0, 0, 4, 16)}, {"h": (1, 1, 4, 16), "t": (0, 0, 16, 4)}],
            "met",
        ),
        # tova per head finds 5 needles at 2K in round 1: pooled 5 against the blend's 4
        (
            [{"h": (1, 1, 16, 4), "t": (0, 5, 4, 16)}, {"h": (1, 1, 4, 16), "t": (0, 0, 16, 4)}],
            "not met",
        ),
    ],
)
def test_pooled_retrieval_rule(tmp_path, rounds, verdict):
    blend = (2, 2, 10, 10)
    dirs = []
    for i, by in enumerate(rounds):
        d = tmp_path / f"round{i}"
        correct = {("blend@0.75:ranker:ranker_peak_tier_smollm2_cpu+tova", "global"): blend}
        correct |= {("h2o", "head"): by["h"], ("tova", "head"): by["t"]}
        _pooled_round(d, correct)
        dirs.append(d)
    cmd = [sys.executable, SCRIPTS / "retrieval_pooled.py", *dirs, "--expect", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert out.rstrip().endswith(f"Verdict: {verdict}.")
    partial = subprocess.run(cmd[:3] + ["--expect", "2"], capture_output=True, text=True)
    assert "Verdict: pending (1 of 2 rounds" in partial.stdout


def test_pooled_retrieval_refuses_an_unfinished_or_missing_run(tmp_path):
    _pooled_round(tmp_path / "r", {})
    path = tmp_path / "r" / "retrieval_head" / "retrieval.json"
    doc = json.loads(path.read_text())
    doc["results"] = [row for row in doc["results"] if row["policy"] != "snapkv"]
    path.write_text(json.dumps(doc))
    cmd = [sys.executable, SCRIPTS / "retrieval_pooled.py", tmp_path / "r"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode != 0 and "no complete snapkv run at head" in run.stderr
    path.write_text(json.dumps(doc | {"complete": False}))
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode != 0 and "did not finish" in run.stderr


def _fake_python(tmp_path) -> tuple[Path, Path]:
    """(log, python): a stand-in for jaxkv's Python that records each call's arguments in
    the log, one line per call, and runs nothing."""
    log, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    return log, fake


@pytest.mark.parametrize(
    "command, seed, folder",
    [("retrieval6", 11, "round6"), ("retrieval11", 16, "round11"), ("retrieval12", 17, "round12")],
)
def test_peak_tova_rounds_read_their_own_data_seed(tmp_path, command, seed, folder):
    """Each retrieval round runs on its own data seed into its own folder (``retrieval12`` once
    ran round 2's seed 9 into round2/, a name matched by its last digit), 16 prompts per cell."""
    log, fake = _fake_python(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", SCRIPTS / "distillcache_peak_tova.sh", command], env=env, check=True)
    calls = log.read_text().splitlines()
    assert len(calls) == 2  # global, then per head
    for call, granularity in zip(calls, ("global", "head"), strict=True):
        args = call.split()
        assert args[args.index("--data-seed") + 1] == str(seed)
        assert args[args.index("--limit") + 1] == "16"
        assert args[args.index("--out") + 1] == str(
            tmp_path / "out" / folder / f"retrieval_{granularity}"
        )


def _part_calls(tmp_path, script: str, part: str) -> tuple[list[list[str]], Path, dict]:
    """The ``python -m jaxkv.eval`` calls of ``script part PART`` (a fake Python records
    them; kvpress's step is marked done), its output folder and environment."""
    log, fake = _fake_python(tmp_path)
    out = tmp_path / "out"
    (out / f"part{part}").mkdir(parents=True)
    (out / f"part{part}" / "kvpress.json").write_text("{}")  # kvpress's step: done already
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(out)}
    subprocess.run(["bash", SCRIPTS / script, "part", part], env=env, check=True)
    calls = [c.split() for c in log.read_text().splitlines() if c.startswith("-m jaxkv.eval")]
    for args in calls:
        flags = {"--heldout": part, "--offset": "3072", "--limit": "8", "--protocol": "prefill"}
        assert {k: args[args.index(k) + 1] for k in flags} == flags
        assert Path(args[args.index("--out") + 1]).parent == out / f"part{part}"
    return calls, out, env


def _request(args: list[str]) -> str | None:
    return args[args.index("--kvzip-request") + 1] if "--kvzip-request" in args else None


@pytest.mark.parametrize(
    "part, granularities",
    [
        ("0.9375", ["global", "global", "head", "layer", "adaptive", "shared"]),
        ("0.6875", ["global", "global"]),  # the amendment: global in both allocations only
    ],
)
def test_prefill_pooled_parts_read_the_unread_second_halves(tmp_path, part, granularities):
    """Each part of the pooled prefill test reads the 8 windows after the first 8 of its slice
    (PROTOCOL.md) into its own folder, in every run, with kvzip's repeat request of its
    recorded runs (chat); an unknown part is refused."""
    calls, _, env = _part_calls(tmp_path, "distillcache_prefill_pooled.sh", part)
    assert [args[args.index("--granularity") + 1] for args in calls] == granularities
    assert "--head-floor" in calls[0] and "--head-floor" not in calls[1]
    assert {_request(args) for args in calls} == {"chat"}
    script = SCRIPTS / "distillcache_prefill_pooled.sh"
    bad = subprocess.run(["bash", script, "part", "0.5"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "one of 0.9375 0.6875 0.4375 0.1875" in bad.stderr


@pytest.mark.parametrize("part, first", [("0.875", True), ("0.125", False)])
def test_kvzip_plain_parts_run_both_requests_on_unread_windows(tmp_path, part, first):
    """results/distillcache_kvzip_plain/PROTOCOL.md: per part, global without floor or cap with
    the plain request (the default: no flag) and with the chat one, and on the first part the
    default allocation's heuristics too."""
    calls, _, _ = _part_calls(tmp_path, "distillcache_kvzip_plain.sh", part)
    runs = [(Path(args[args.index("--out") + 1]).name, _request(args)) for args in calls]
    want = [("prefill_global_nocap", None), ("prefill_global_nocap_chat", "chat")]
    assert runs == want + ([("prefill_global", None)] if first else [])
    assert all("--head-floor" in args for args in calls[:2])


def test_ranker_kvzip_plain_validation_reads_only_the_training_domains(tmp_path):
    """The choice runs on the training domains' validation text, the plain request, the
    recommendation's allocation, the candidate's rerank beside the shipped one's and kvzip."""
    log, fake = _fake_python(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    script = SCRIPTS / "ranker_kvzip_plain.sh"
    subprocess.run(["bash", script, "validate"], env=env, check=True, cwd=tmp_path)
    (args,) = [c.split() for c in log.read_text().splitlines() if c.startswith("-m jaxkv.eval")]
    flag = {k: args[args.index(k) + 1] for k in ("--text", "--kvzip-request", "--head-cap")}
    assert flag == {
        "--text": "runs/kvzip_plain/val_train_domains.txt",
        "--kvzip-request": "plain",
        "--head-cap": "8",
    }
    policies = args[args.index("--policies") + 1].split(",")
    assert policies[:3] == [
        "rerank@0.5:ranker:runs/kvzip_plain/ranker",
        "rerank@0.5:ranker:ranker_kvzip_smollm2_cpu",
        "kvzip",
    ]
    assert "validation_text" in log.read_text()  # the text: the training domains' tails
