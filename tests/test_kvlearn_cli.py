"""CLI: the README example, JSON schema, input errors, offline pre-training round trip."""

import json
import re

import pytest

from jaxkv.kvlearn import baselines as B
from jaxkv.kvlearn import features as F
from jaxkv.kvlearn import traces as T
from jaxkv.kvlearn.cli import eval_main, train_main

FIELDS = {
    "policy",
    "ttft_ms_mean",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "hit_rate",
    "transfer_gib",
    "admits",
    "evictions",
}


def test_readme_example_prints_every_policy_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert eval_main(["3000", "1.1", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "requests=3000  keys=130  zipf_alpha=1.1  pool_GiB=4" in text
    for name in B.POLICIES:
        assert f"\n{name} " in text
    data = json.loads(out.read_text())
    assert data["config"]["n_requests"] == 3000 and data["config"]["pool_gib"] == 4
    assert [r["policy"] for r in data["results"]] == list(B.POLICIES)
    for r in data["results"]:
        assert FIELDS <= r.keys()
    res = {r["policy"]: r for r in data["results"]}
    assert res["no_cache"]["hit_rate"] == 0.0 and res["no_cache"]["admits"] == 0
    assert res["lru"]["ttft_ms_mean"] < res["no_cache"]["ttft_ms_mean"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["0"], "n_requests: must be a positive integer"),
        (["100", "0"], "zipf alpha must be > 0"),
        (["100", "1.1", "-4"], "pool size must be ≥ 0 GiB"),
        (["--policies", "lru,fifo"], "unknown policies \\['fifo'\\]"),
    ],
)
def test_bad_arguments_exit_with_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        eval_main(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bad_trace_file_reports_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "key": "a", "tokens": 10, "modality": "text"}\n{"t": 1}\n')
    assert eval_main(["--trace", str(path), "--policies", "lru"]) == 2
    assert "t.jsonl:2: missing fields" in capsys.readouterr().err
    assert eval_main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


def test_trace_file_and_pretrained_prp_round_trip(tmp_path, capsys, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    T.save_jsonl(T.zipf_multimodal(2000, 1.1, seed=3), trace)
    ck = tmp_path / "prp"
    assert (
        train_main(["--trace", str(trace), "--epochs", "2", "--pool-gib", "2", "--out", str(ck)])
        == 0
    )
    out = capsys.readouterr().out
    assert "epoch   2" in out and f"saved PRP to {ck}" in out
    js = tmp_path / "r.json"
    argv = [
        "--trace",
        str(trace),
        "--policies",
        "lru,kvlearn",
        "--prp-checkpoint",
        str(ck),
        "--json",
        str(js),
    ]
    assert eval_main(argv) == 0
    data = json.loads(js.read_text())
    assert data["config"]["prp_checkpoint"] == str(ck) and data["config"]["n_requests"] == 2000
    assert [r["policy"] for r in data["results"]] == ["lru", "kvlearn"]
    assert eval_main(["--prp-checkpoint", str(tmp_path / "none"), "--policies", "kvlearn"]) == 2
    capsys.readouterr()
    monkeypatch.setattr(F, "FEATURES_VERSION", F.FEATURES_VERSION + 1)  # features changed since
    assert eval_main(["--prp-checkpoint", str(ck), "--policies", "kvlearn"]) == 2
    assert "features version" in capsys.readouterr().err


def test_sweep_writes_plot_and_json(tmp_path, capsys):
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    argv = [
        "400",
        "--sweep",
        "--pools",
        "1,4",
        "--alphas",
        "0.8,1.4",
        "--seeds",
        "2",
        "--policies",
        "no_cache,lru",
    ]
    assert eval_main(argv + ["--plot", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "alpha=0.8: median TTFT (ms) over 2 seeds" in out and "alpha=1.4" in out
    assert png.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert len(data["runs"]) == 2 * 2 * 2 * 2 and len(data["summary"]) == 2 * 2 * 2
    cell = {(r["policy"], r["alpha"], r["pool_gib"]): r for r in data["summary"]}
    assert (
        cell[("lru", 0.8, 4)]["ttft_ms_mean_median"]
        < cell[("no_cache", 0.8, 4)]["ttft_ms_mean_median"]
    )
