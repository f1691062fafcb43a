"""Bad and extreme inputs to KVLearn (issue 12): int32 sizes, one strict Mooncake loader, outputs
and arguments checked before any work, progress on stderr, tables that widen, the shipped trace."""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import data as data_lib
from jaxkv.cli import kvlearn as cli_lib
from jaxkv.cli.kvlearn import eval_main, train_main
from jaxkv.kvlearn import calibrate as calibrate_lib
from jaxkv.kvlearn import report, workloads
from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.core.control import KVLearnConfig
from jaxkv.kvlearn.core.facade import Coordinator
from jaxkv.kvlearn.cost import GIB, CostModel
from jaxkv.kvlearn.serving import metrics as serving_metrics
from jaxkv.kvlearn.sim import simulate as simulate_lib

ROOT = Path(__file__).resolve().parents[1]
SERVE_FLAGS = cli_lib.SERVE_FLAGS
LLAMA_BPT = CostModel.llama3_8b_a100().shape.bytes_per_token  # 128 KiB per token


def _boom(*args, **kwargs):
    raise AssertionError("simulation work started before the arguments were checked")


def _mooncake_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- 1: sizes beyond int32 ------------------------------------------------------------------
@pytest.mark.parametrize("bpt", [LLAMA_BPT, 46_080, 327_680, 1000, 1])
def test_block_kib_is_exact_or_saturates_for_every_int32_token_count(bpt):
    tokens = [1, 7, 1023, 1024, 16_383, 16_384, 20_000, 2**24 - 1, 2**24, 20_000_000, 2**31 - 1]
    want = [min(-(-t * bpt // 1024), pool_lib.MAX_KIB) for t in tokens]
    got_jax = pool_lib.block_kib(jnp.asarray(tokens, jnp.int32), bytes_per_token=bpt)
    assert got_jax.dtype == jnp.int32
    for t, w, g in zip(tokens, want, np.asarray(got_jax).tolist(), strict=True):
        # exact wherever the true size could fit in a pool; saturated (≥ any pool) otherwise
        assert g == w or (g == pool_lib.MAX_KIB and w > pool_lib.MAX_CAPACITY_KIB), (t, w, g)
    got_np = pool_lib.block_kib(np.asarray(tokens, np.int64), bytes_per_token=bpt)
    assert got_np.tolist() == want


def test_core_simulator_never_admits_a_block_larger_than_the_pool():
    # 2^24 tokens of LLaMA-3-8B are 2 TiB (2^31 KiB); 20M tokens are the 2.4 TiB of the report
    tokens = np.array([100, 2**24, 20_000_000], np.int32)
    key = np.arange(30, dtype=np.int32) % 3
    tr = traces_lib.Trace(
        key, tokens[key], np.zeros(30, np.int32), np.arange(30) * 0.05, ("s", "b", "c")
    )
    for policy in ("lru", "lfu", "belady"):
        r = simulate_lib.run(policy, tr, capacity_bytes=4 * GIB)
        assert r["admits"] == 1, policy  # only the small block
        assert r["hit_rate"] == pytest.approx(9 / 30)
        moved = (10 * (100 + 2**24 + 20_000_000) + 100) * LLAMA_BPT  # requests + one admit
        assert r["transfer_gib"] == pytest.approx(moved / GIB)


def test_kvlearn_never_admits_a_block_larger_than_the_pool():
    # 20,000 tokens = 2.44 GiB: tokens · 131072 overflowed int32 inside admit (negative KiB)
    coord = Coordinator(KVLearnConfig(), capacity_bytes=GIB)
    for i in range(200):
        key, tok = ("big", 20_000) if i % 10 == 0 else (f"s{i % 7}", 100)
        if not coord.lookup(key, tokens=tok, now=i * 0.1):
            assert not coord.admit(key, tokens=tok).admitted or key != "big"
        if i % 20 == 19:
            coord.tick(now=i * 0.1)
    stats = coord.stats()
    assert 0 <= stats["used_bytes"] <= stats["capacity_bytes"]
    assert "big" not in coord.resident()


def test_pool_at_its_largest_capacity_keeps_exact_accounting():
    cap = pool_lib.MAX_CAPACITY_KIB  # used + kib of the second block wraps int32; the need does not
    pool = pool_lib.init_pool(max_blocks=4, max_keys=4, capacity_kib=cap)
    pool, ok, _ = pool_lib.admit(pool, key=0, kib=1500 * 2**20, rank=0.0, value=0.0)
    assert bool(ok)
    pool, ok, victims = pool_lib.admit(pool, key=1, kib=1000 * 2**20, rank=1.0, value=0.0)
    assert bool(ok) and np.asarray(victims.key_E)[0] == 0
    assert 0 <= int(pool.used_kib) <= cap and int(pool.used_kib) == 1000 * 2**20


def test_capacities_beyond_the_int32_accounting_are_refused(capsys):
    tr = workloads.zipf_multimodal(50, 1.1, seed=0)
    with pytest.raises(ValueError, match="2047 GiB"):
        simulate_lib.run("lru", tr, capacity_bytes=3 * 2**40)
    with pytest.raises(ValueError, match="2047 GiB"):
        Coordinator(KVLearnConfig(), capacity_bytes=3 * 2**40)
    with pytest.raises(SystemExit):
        eval_main(["100", "1.1", "5000"])
    assert "argument pool_gib: pool size must be ≤ 2047 GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_main(["100", "--sweep", "--pools", "1,5000"])
    assert "argument --pools: pool size must be ≤ 2047 GiB, got 5000" in capsys.readouterr().err


def test_token_counts_beyond_int32_are_refused_where_they_enter(tmp_path):
    good = {"t": 0.5, "key": "a", "tokens": 576, "modality": "text"}
    path = tmp_path / "big.jsonl"
    path.write_text(
        json.dumps(good) + "\n" + json.dumps(good | {"key": "b", "tokens": 2**31}) + "\n"
    )
    with pytest.raises(
        traces_lib.TraceError, match=r"big.jsonl:2: 'tokens' must be at most 2,147,483,647"
    ):
        traces_lib.load_jsonl(path)
    coord = Coordinator(KVLearnConfig(max_blocks=2, max_keys=2), capacity_bytes=GIB)
    with pytest.raises(ValueError, match="tokens must be in 1..2,147,483,647"):
        coord.lookup("a", tokens=2**31)


# ---- 2: one strict Mooncake loader ----------------------------------------------------------
FIRST = {"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [0]}


@pytest.mark.parametrize(
    "second, message",
    [
        (FIRST | {"hash_ids": ["1"]}, "'hash_ids' must be a list of integers, got element '1'"),
        (FIRST | {"hash_ids": "1"}, "'hash_ids' must be a list of integers"),
        (FIRST | {"hash_ids": [True]}, "'hash_ids' must be a list of integers, got element True"),
        (FIRST | {"hash_ids": [1.0]}, "'hash_ids' must be a list of integers, got element 1.0"),
        (FIRST | {"input_length": "10"}, "'input_length' must be an integer > 0"),
        (FIRST | {"input_length": 10.0}, "'input_length' must be an integer > 0"),
        (FIRST | {"output_length": -1}, "'output_length' must be an integer ≥ 0"),
        ({k: v for k, v in FIRST.items() if k != "output_length"}, "missing field"),
        (FIRST | {"timestamp": "5"}, "'timestamp' must be a finite number ≥ 0"),
        (FIRST | {"timestamp": float("nan")}, "'timestamp' must be a finite number ≥ 0"),
        (FIRST | {"timestamp": 1}, "timestamp 1.0 goes backwards"),
        (FIRST | {"input_length": 600}, "1 hash_ids for input_length 600"),
    ],
)
def test_every_mooncake_path_validates_the_same_way(tmp_path, capsys, second, message):
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps(FIRST) + "\n" + json.dumps(second) + "\n")
    pattern = "mc.jsonl:2: " + re.escape(message)
    for load in (traces_lib.load_mooncake, traces_lib.load_mooncake_trace):
        with pytest.raises(traces_lib.TraceError, match=pattern):
            load(path)
    for argv in (
        ["sim", "--mooncake", str(path)],
        ["serve", "--trace", str(path), "--pool-gib", "1"],
    ):
        assert eval_main(argv) == 2
        assert re.search(pattern, capsys.readouterr().err)


def test_mooncake_blocks_keep_the_largest_length_and_the_file_hashes(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [7, 99]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 99]},
    ]
    tr = traces_lib.load_mooncake(_mooncake_file(tmp_path / "mc.jsonl", rows))
    assert tr.names == ("mc/7", "mc/99")
    np.testing.assert_array_equal(tr.tokens, [512, 512, 512, 512])
    np.testing.assert_allclose(tr.time_s, [0, 0, 1e-3, 1e-3])


# ---- 3: outputs checked before any work -----------------------------------------------------
def test_core_outputs_are_checked_before_the_workload_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workloads, "zipf_multimodal", _boom)
    monkeypatch.setattr(simulate_lib, "compare", _boom)
    monkeypatch.setattr(simulate_lib, "sweep", _boom)
    assert eval_main(["100", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path}: is a directory" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert eval_main(["100", "--json", str(blocker / "r.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert eval_main(["100", "--sweep", "--plot", str(tmp_path)]) == 2
    assert "--plot" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [blocker]


def test_serving_outputs_are_checked_before_the_trace_is_read(tmp_path, capsys, monkeypatch):
    path = _mooncake_file(tmp_path / "mc.jsonl", [FIRST])
    monkeypatch.setattr(traces_lib, "load_mooncake_trace", _boom)
    monkeypatch.setattr(serving_metrics, "compare", _boom)
    argv = ["serve", "--trace", str(path), "--pool-gib", "1", "--json", str(tmp_path)]
    assert eval_main(argv) == 2
    assert "is a directory" in capsys.readouterr().err
    assert eval_main(["serve", "--trace", str(path), "--sweep", "--plot", str(tmp_path)]) == 2
    assert "--plot" in capsys.readouterr().err


def test_train_checks_out_before_collecting_labels(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(simulate_lib, "collect_labels", _boom)
    (tmp_path / "file").write_text("")
    assert train_main(["--n-requests", "10", "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert train_main(["--n-requests", "10", "--out", str(tmp_path / "full")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_other_kvlearn_commands_check_outputs_first(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workloads, "mm_session", _boom)
    assert eval_main(["workload", "mmsession", "--sessions", "3", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    monkeypatch.setattr(calibrate_lib, "calibrate", _boom)
    assert eval_main(["calibrate", "--model", "tiny", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


# ---- 4: every argument range-checked up front, naming the flag, bound and value -------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pool-gib", "-1"], "argument --pool-gib: must be > 0, got -1"),
        (["--pool-frac", "-0.1"], "argument --pool-frac: must be ≥ 0, got -0.1"),
        (["--pool-frac", "1.5"], "argument --pool-frac: must be ≤ 1, got 1.5"),
        (["--prefill-nodes", "0"], "argument --prefill-nodes: must be ≥ 1, got 0"),
        (["--prefill-nodes", "2.5"], "argument --prefill-nodes: must be an integer, got '2.5'"),
        (["--load-scale", "-2"], "argument --load-scale: must be > 0, got -2"),
        (["--load-scale", "inf"], "argument --load-scale: must be a finite number, got inf"),
        (["--slo-ms", "0"], "argument --slo-ms: must be > 0, got 0"),
        (["--attainment", "1.5"], "argument --attainment: must be ≤ 1, got 1.5"),
        (["--attainment", "0"], "argument --attainment: must be > 0, got 0"),
        (["--decode-nodes", "0"], "argument --decode-nodes: must be ≥ 1, got 0"),
        (["--decode-slots", "-3"], "argument --decode-slots: must be ≥ 1, got -3"),
        (["--tpot-ms", "-1"], "argument --tpot-ms: must be ≥ 0, got -1"),
        (["--loads", "1,-1"], "argument --loads: must be > 0, got -1"),
        (["--loads", ","], "argument --loads: needs at least one value"),
        (["--fracs", "0.1,2"], "argument --fracs: must be ≤ 1, got 2"),
        (["--horizon", "0"], "argument --horizon: must be > 0, got 0"),
        (["--seed", "-1"], "argument --seed: must be ≥ 0, got -1"),
        (["--tick-every", "0"], "argument --tick-every: must be a positive integer, got 0"),
        (["--cost-preset", "gpt"], "argument --cost-preset: invalid choice: 'gpt'"),
        (["--alphas", "1,0"], "argument --alphas: zipf alpha must be > 0, got 0"),
        (["--seeds", "0"], "argument --seeds: must be a positive integer, got 0"),
        (["-5"], "n_requests: must be a positive integer, got -5"),
        (["abc"], "n_requests: must be a positive integer, got abc"),
        (["10", "1.1", "nan"], "pool_gib: pool size must be ≥ 0 GiB, got nan"),
    ],
)
def test_eval_arguments_out_of_range_name_flag_bound_and_value(argv, message, capsys):
    if argv[0] in SERVE_FLAGS:
        argv = ["serve", "--trace", "T", *argv]
    with pytest.raises(SystemExit) as e:
        eval_main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pool-gib", "-1"], "argument --pool-gib: pool size must be ≥ 0 GiB, got -1"),
        (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
        (["--n-requests", "0"], "argument --n-requests: must be a positive integer, got 0"),
        (["--alpha", "-1"], "argument --alpha: zipf alpha must be > 0, got -1"),
    ],
)
def test_train_arguments_out_of_range(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(argv + ["--out", str(tmp_path / "ck")])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_mmsession_and_calibrate_arguments_out_of_range(tmp_path, capsys):
    for argv, message in [
        (["--sessions", "0"], "argument --sessions: must be ≥ 1, got 0"),
        (["--rate", "0"], "argument --rate: must be > 0, got 0"),
        (["--seed", "-2"], "argument --seed: must be ≥ 0, got -2"),
    ]:
        with pytest.raises(SystemExit):
            eval_main(["workload", "mmsession", *argv, "--out", str(tmp_path / "mm.jsonl")])
        assert message in capsys.readouterr().err
    for argv, message in [
        (["--repeats", "0"], "argument --repeats: must be ≥ 1, got 0"),
        (["--lengths", "64,-1"], "argument --lengths: must be ≥ 1, got -1"),
    ]:
        with pytest.raises(SystemExit):
            eval_main(["calibrate"] + argv)
        assert message in capsys.readouterr().err


def test_mode_rules_are_checked_before_the_trace_is_read(tmp_path, capsys, monkeypatch):
    path = str(_mooncake_file(tmp_path / "mc.jsonl", [FIRST]))
    monkeypatch.setattr(traces_lib, "load_mooncake_trace", _boom)
    monkeypatch.setattr(traces_lib, "load_mooncake", _boom)
    monkeypatch.setattr(workloads, "zipf_multimodal", _boom)
    returns = [  # rules on flag combinations: "<prog>: error: ...", exit status 2
        (["serve", "--trace", path], "serve needs the pool size: --pool-gib G or --pool-frac F"),
        (["serve", "--trace", path, "--sweep", "--pool-frac", "0.1"], "--sweep takes pool sizes"),
        (["serve", "--trace", path, "--sweep", "--rate-search"], "drop --rate-search"),
        (["sim", "--mooncake", path, "--sweep"], "--sweep runs the Zipf workload"),
    ]
    for argv, message in returns:
        assert eval_main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    exits = [  # argparse: usage and "error: ...", exit status 2
        (["serve", "--trace", path, "--pool-gib", "1", "--pool-frac", "0.5"], "not allowed with"),
        (["serve", "--trace", path, "1", "2", "--pool-gib", "1"], "unrecognized arguments: 2"),
        (
            ["serve", "--trace", path, "--pool-gib", "1", "--policies", "random_lru"],
            "of `kvlearn sim`",
        ),
        (
            ["serve", "--trace", path, "--pool-gib", "1", "--prp-checkpoint", "x"],
            "of `kvlearn sim`",
        ),
        (["sim", "--trace", path, "--mooncake", path], "not allowed with argument --trace"),
        (["100", "1.1", "2", "--pool-gib", "1"], "--pool-gib: flags of `kvlearn serve`"),
        (["100", "--pool-frac", "0.5"], "--pool-frac: flags of `kvlearn serve`"),
        (["100", "--rate-search"], "--rate-search: flags of `kvlearn serve`"),
        (["100", "--policies", "mooncake"], "(mooncake: policies of `kvlearn serve`)"),
    ]
    for argv, message in exits:
        with pytest.raises(SystemExit) as e:
            eval_main(argv)
        assert e.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


# ---- 5: progress on stderr ------------------------------------------------------------------
def test_large_traces_show_progress_on_stderr_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_lib, "PROGRESS_MIN_REQUESTS", 100)
    monkeypatch.setattr(cli_lib, "PROGRESS_MIN_BYTES", 1000)
    trace = tmp_path / "t.jsonl"
    traces_lib.save_jsonl(workloads.zipf_multimodal(300, 1.1, seed=0), trace)
    out = tmp_path / "r.json"
    assert eval_main(["--trace", str(trace), "--policies", "lru", "--json", str(out)]) == 0
    text = capsys.readouterr()
    assert "loading trace: 100%" in text.err and "replay: 100%" in text.err
    assert "300/300" in text.err
    assert "%|" not in text.out and "\r" not in text.out
    assert json.loads(out.read_text())["results"][0]["policy"] == "lru"
    rows = [
        {"timestamp": 10 * i, "input_length": 1024, "output_length": 1, "hash_ids": [0, i + 1]}
        for i in range(60)
    ]
    path = _mooncake_file(tmp_path / "mc.jsonl", rows)
    argv = ["serve", "--trace", str(path), "--pool-gib", "1", "--policies", "lru,mooncake"]
    assert eval_main(argv) == 0
    text = capsys.readouterr()
    assert "replay: 100%" in text.err and "120/120" in text.err
    assert "%|" not in text.out


def test_small_work_shows_no_progress_bar(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    traces_lib.save_jsonl(workloads.zipf_multimodal(300, 1.1, seed=0), trace)
    assert eval_main(["--trace", str(trace), "--policies", "lru"]) == 0
    assert capsys.readouterr().err == ""
    assert cli_lib.PROGRESS_MIN_REQUESTS == 100_000


# ---- 6: tables widen for wide values --------------------------------------------------------
def _assert_aligned(table: str, n_columns: int) -> None:
    lines = table.split("\n")
    assert len({len(line) for line in lines}) == 1, lines  # header, rule and rows equally wide
    assert set(lines[1]) == {"-"}
    ends = lambda line: [m.end() for m in re.finditer(r"\S+", line)]
    rows = lines[2:]
    for row in rows:
        assert len(ends(row)) == n_columns, row  # no two values ran together
        assert ends(row)[1:] == ends(rows[0])[1:], row  # right-aligned columns line up
        assert set(ends(row)[1:]) <= set(ends(lines[0])), row  # under their headers


def test_core_table_stays_aligned_with_huge_numbers():
    normal = {
        "policy": "lru",
        "ttft_ms_mean": 4.234,
        "ttft_ms_p50": 1.01,
        "ttft_ms_p99": 22.49,
        "hit_rate": 0.788,
        "byte_hit_rate": 0.639,
        "transfer_gib": 144.3,
        "admits": 637,
        "evictions": 561,
        "discards": 0,
    }
    huge = normal | {
        "policy": "a_very_long_policy_name",
        "ttft_ms_mean": 123456789.0,
        "ttft_ms_p50": 98765432.1,
        "ttft_ms_p99": 1e12,
        "transfer_gib": 1e7,
        "admits": 10**12,
        "evictions": 10**11,
        "discards": 10**10,
    }
    _assert_aligned(report.sim_table([normal, huge]), 10)
    # ordinary values keep the README layout
    assert report.sim_table([normal]).split("\n")[2] == (
        "lru                 4.234    1.01   22.49    78.8       63.9     144.3     637       561        0"
    )


def test_serving_table_stays_aligned_with_huge_numbers():
    row = {
        "policy": "mooncake",
        "ttft_ms_mean": 2821.9,
        "ttft_ms_p50": 240.7,
        "ttft_ms_p99": 25466.0,
        "hit_rate": 0.417,
        "token_hit_rate": 0.425,
        "transfer_gib": 14626.0,
        "wait_ms_mean": 0.0,
        "goodput_rps": 3.876,
        "throughput_rps": None,
        "e2e_ms_mean": 6550.0,
        "wall_s": 0.52,
    }
    huge = row | {
        "ttft_ms_mean": 123456789.0,
        "ttft_ms_p99": 9.9e13,
        "transfer_gib": 1e7,
        "wait_ms_mean": 1e12,
        "throughput_rps": 123456.789,
        "e2e_ms_mean": 1e15,
        "wall_s": 123456.0,
    }
    table = report.serve_table([row, huge])
    _assert_aligned(table, 12)
    assert report.serve_table([row]).split("\n")[2] == (
        "mooncake           2821.9     240.7    25466.0      41.7      42.5     14626       0.0"
        "    3.876        -      6550   0.52"
    )


# ---- 7: the shipped example trace -----------------------------------------------------------
def test_example_names_the_shipped_mooncake_trace(tmp_path, capsys):
    assert traces_lib.trace_path("example") == data_lib.data_file(data_lib.MOONCAKE_EXAMPLE)
    assert traces_lib.trace_path("other.jsonl") == Path("other.jsonl")
    out = tmp_path / "r.json"
    argv = ["serve", "40", "--trace", "example", "--pool-frac", "0.1", "--policies", "mooncake"]
    assert eval_main(argv + ["--json", str(out)]) == 0
    assert "trace=example  requests=40  distinct_blocks=43924" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["trace"] == "example"
    assert eval_main(["2000", "1.1", "4", "--mooncake", "example", "--policies", "lru"]) == 0
    assert "requests=2000" in capsys.readouterr().out


def test_benchmarks_use_the_shipped_trace():
    for name in ("bench_kvlearn_serving.py", "bench_kvlearn_all.sh"):
        text = (ROOT / "scripts" / name).read_text()
        assert "shared/data" not in text, name
