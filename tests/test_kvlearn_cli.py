"""CLI (``jaxkv/cli/kvlearn.py``): the README example, explicit subcommands, JSON schema, input
errors, offline pre-training round trip."""

import json
import re

import pytest

from jaxkv.cli import kvlearn as cli_lib
from jaxkv.cli.kvlearn import eval_main, train_main
from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.core import features as features_lib
from jaxkv.kvlearn.sim.policies import POOL_POLICIES

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
    for name in POOL_POLICIES:
        assert f"\n{name} " in text
    data = json.loads(out.read_text())
    assert data["config"]["n_requests"] == 3000 and data["config"]["pool_gib"] == 4
    assert [r["policy"] for r in data["results"]] == list(POOL_POLICIES)
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
    traces_lib.save_jsonl(workloads.zipf_multimodal(2000, 1.1, seed=3), trace)
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
    # the features changed since
    monkeypatch.setattr(features_lib, "FEATURES_VERSION", features_lib.FEATURES_VERSION + 1)
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


def test_subcommands_are_explicit(tmp_path, capsys):
    """A first argument that is not a subcommand means ``sim``; ``serve`` never falls back to
    the core simulator and ``sim`` never to the serving one, whatever the trace file holds."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert eval_main(["300", "1.1", "2", "--policies", "lru", "--json", str(a)]) == 0
    assert eval_main(["sim", "300", "1.1", "2", "--policies", "lru", "--json", str(b)]) == 0
    assert json.loads(a.read_text())["results"] == json.loads(b.read_text())["results"]
    capsys.readouterr()
    # a Mooncake file given to sim --trace is an error, not a switch to the serving simulator
    assert eval_main(["sim", "--trace", "example", "--policies", "lru"]) == 2
    assert "a Mooncake record" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # serve flags are not sim's
        eval_main(["--trace", "example", "--pool-frac", "0.1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--pool-frac: flags of `kvlearn serve`" in err
    with pytest.raises(SystemExit):  # serve's trace is required
        eval_main(["serve", "--pool-gib", "1"])
    assert "--trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        eval_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "{sim,serve,calibrate,workload}" in out and "means ``sim``" in out


def test_the_pool_size_has_one_spelling_per_simulator(capsys):
    with pytest.raises(SystemExit):  # sim: positional only
        eval_main(["100", "1.1", "2", "--pool-gib", "1"])
    assert "sim` takes the pool size as its third positional argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # serve: --pool-gib or --pool-frac, not both
        eval_main(["serve", "--trace", "example", "--pool-gib", "1", "--pool-frac", "0.1"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # serve has no positional pool size
        eval_main(["serve", "10", "2", "--trace", "example"])
    assert "unrecognized arguments: 2" in capsys.readouterr().err
    assert eval_main(["serve", "--trace", "example", "--sweep", "--pool-gib", "1"]) == 2
    assert "--sweep takes pool sizes from --fracs" in capsys.readouterr().err


def test_workload_mmsession_writes_a_serve_trace(tmp_path, capsys):
    out = tmp_path / "mm.jsonl"
    assert eval_main(["workload", "mmsession", "--sessions", "5", "--out", str(out)]) == 0
    recs = workloads.mm_session(5, seed=0, cfg=workloads.MMSessionConfig())
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in recs)
    assert f"from 5 sessions to {out}" in capsys.readouterr().out
    argv = ["serve", "--trace", str(out), "--pool-frac", "0.5", "--policies", "mooncake"]
    assert eval_main(argv) == 0
    assert cli_lib.PROGRESS_MIN_REQUESTS == 100_000
