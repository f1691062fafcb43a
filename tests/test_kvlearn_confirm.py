"""scripts/bench_kvlearn_serving.py --confirm: a fixed KVLearn setting on freshly seeded
workloads, every cell held out (a tiny scale; the reported run uses the protocol's sizes)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kvlearn_serving.py"
_spec = importlib.util.spec_from_file_location("bench_kvlearn_serving", _SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory):
    out = tmp_path_factory.mktemp("confirm")
    cost = bench.CostModel.llama3_8b_a100()
    bench.confirm(cost, out, seed=999, setting="guard:moon+ca+gdsf,0%", scale=0.01)
    return out


def test_confirm_reports_every_cell_of_the_four_seeded_workloads(confirmed):
    doc = json.loads((confirmed / "confirm_seed999.json").read_text())
    assert [f["held_out"] for f in doc["folds"]] == ["chat", "agent", "rag", "mmsession"]
    assert doc["config"]["seed"] == 999
    assert doc["summary"]["cells"] == 4 * len(bench.FRACS)
    for fold in doc["folds"]:
        assert fold["chosen"] == "guard:moon+ca+gdsf,0%"
        for cell in fold["cells"]:
            pol = cell["policies"]
            classical = {c: pol[c] for c in bench.CLASSICAL}
            best = min(classical.values(), key=lambda m: m["ttft_ms_mean"])
            assert pol[cell["best_classical"]] == best
            assert cell["ratio_mean"] == pol["kvlearn"]["ttft_ms_mean"] / best["ttft_ms_mean"]
            low_p99 = min(m["ttft_ms_p99"] for m in classical.values())
            assert cell["ratio_p99"] == pol["kvlearn"]["ttft_ms_p99"] / low_p99
    md = (confirmed / "confirm_seed999.md").read_text()
    assert "--confirm 999" in md and "| chat | guard:moon+ca+gdsf,0% | 10% |" in md


def test_confirm_workloads_differ_from_the_protocols():
    fresh = bench.protocol_workloads(0.01, seed=999)
    protocol = bench.protocol_workloads(0.01)
    assert list(fresh) == ["chat", "agent", "rag", "mmsession"]
    assert "example" in protocol
    for kind in fresh:
        assert fresh[kind].blocks[0].tolist() != protocol[kind].blocks[0].tolist() or (
            fresh[kind].time_s.tolist() != protocol[kind].time_s.tolist()
        )


def _select_file(out: Path, seed: int, ratios: dict) -> None:
    doc = {"seed": seed, "workloads": ["w"], "pools": list(bench.FRACS), "ratios": ratios}
    (out / f"select_seed{seed}.json").write_text(json.dumps(doc))


def test_select_rule_counts_cells_above_the_bound_then_scores(tmp_path):
    # a: one p99 cell above 1.01; b: none, but a higher score; c: none and the lowest score
    _select_file(tmp_path, 1, {"a": [[0.9, 1.02]], "b": [[1.0, 1.0]], "c": [[1.0, 0.99]]})
    _select_file(tmp_path, 2, {"a": [[0.9, 0.9]], "b": [[1.005, 1.0]], "c": [[1.0, 1.0]]})
    md = bench.select_report(tmp_path)
    assert "| `c` | 0 | 0.9975 | 1.0000 | 1.0000 | **chosen** |" in md
    assert "| `a` | 1 | 0.9300 | 0.9000 | 1.0200 |  |" in md
    assert (tmp_path / "select.md").read_text() == md


def test_select_rule_ties_go_to_grid_order(tmp_path):
    _select_file(tmp_path, 1, {"x": [[1.0, 1.0]], "y": [[1.0, 1.0]]})
    assert "| `x` | 0 | 1.0000 | 1.0000 | 1.0000 | **chosen** |" in bench.select_report(tmp_path)


def test_select_writes_every_candidates_ratios_per_seed(tmp_path):
    cost = bench.CostModel.llama3_8b_a100()
    names = ["guard:moon+ca+gdsf,0%", "guard:moon+ca+ca2+ca4+gdsf,0%"]
    bench.select(cost, tmp_path, seeds=[998], names=names, scale=0.01)
    doc = json.loads((tmp_path / "select_seed998.json").read_text())
    assert list(doc["ratios"]) == names
    assert all(len(r) == 4 * len(bench.FRACS) for r in doc["ratios"].values())
    assert "**chosen**" in (tmp_path / "select.md").read_text()


def _no_wall(runs: dict) -> dict:
    return {k: {m: v for m, v in r.items() if m != "wall_s"} for k, r in runs.items()}


def test_simulate_cells_in_two_processes_gives_the_one_process_runs(monkeypatch):
    # the spawned workers import the script by name, as they do when it runs as a script
    monkeypatch.syspath_prepend(str(_SCRIPT.parent))
    monkeypatch.setitem(sys.modules, "bench_kvlearn_serving", bench)
    traces = bench.protocol_workloads(0.01, seed=997)
    traces = {k: traces[k] for k in ("chat", "rag")}
    cost, rho = bench.CostModel.llama3_8b_a100(), 0.7
    grid = ["gd", "follow:moon+ca+ca2+ca4+gdsf+lfu+s3+gd,s0.25"]
    one, info1 = bench.simulate_cells(traces, cost, grid, rho)
    two, info2 = bench.simulate_cells(traces, cost, grid, rho, jobs=2)
    assert info1 == info2
    assert list(one) == list(two)  # the same order, so the same tables
    assert _no_wall(one) == _no_wall(two)
    assert len(one) == 2 * len(bench.FRACS) * (
        len(grid) + sum(b not in bench.LEARNED for b in bench.BLOCK_POLICIES)
    )


def test_protocol_seed_keeps_the_shipped_trace_beside_the_seeded_workloads():
    seeded = bench.protocol_workloads(0.01, seed=997, example=True)
    assert list(seeded) == ["chat", "agent", "rag", "mmsession", "example"]
    assert (
        seeded["chat"].blocks[0].tolist()
        == bench.protocol_workloads(0.01, seed=997)["chat"].blocks[0].tolist()
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--protocol", "--jobs", "0"], "--jobs must be at least 1"),
        (["--protocol-seed", "5"], "--protocol-seed needs --protocol"),
        (["--grid", "covering"], "--grid needs --protocol"),
        (["--protocol", "--grid", "gd;nope"], "--grid: unknown settings ['nope']"),
    ],
)
def test_cli_rejects_bad_protocol_flags(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_kvlearn_serving.py", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    assert message in capsys.readouterr().err


def test_speed_one_records_the_run_and_the_host_probe(tmp_path):
    tr = bench.traces_lib.load_mooncake_trace(bench.traces_lib.trace_path(bench.TRACE)).head(200)
    cost = bench.CostModel.llama3_8b_a100()
    bench.speed_one(tr, "example", "lru", cost, 24, tmp_path)
    bench.speed_one(tr, "example", "gd", cost, 24, tmp_path)
    doc = json.loads((tmp_path / "serving_speed_one.json").read_text())
    assert list(doc) == ["example | lru", "example | gd"]
    for rec in doc.values():
        assert rec["requests"] == 200 and rec["wall_s"] > 0 and rec["host_probe_s"] > 0


def test_protocol_chooses_only_among_its_grid(tmp_path):
    cost = bench.CostModel.llama3_8b_a100()
    grid = ["gd", "follow:moon+ca+ca2+ca4+gdsf+lfu+s3+gd,s0.25"]
    bench.protocol(cost, tmp_path, scale=0.01, seed=997, grid=grid)
    doc = json.loads((tmp_path / "protocol.json").read_text())
    assert list(doc["config"]["grid"]) == grid and doc["config"]["seed"] == 997
    assert [f["held_out"] for f in doc["folds"]] == ["chat", "agent", "rag", "mmsession", "example"]
    for fold in doc["folds"]:
        assert list(fold["fails"]) == grid and fold["chosen"] in grid
    runs = {r["run"] for r in doc["runs"]}
    assert {f"kvlearn:{g}" for g in grid} <= runs
    assert not any(r.startswith("kvlearn:") and r[8:] not in grid for r in runs)


def test_covering_grid_holds_the_settings_with_every_covering_shadow():
    assert bench.CONFIRM_SETTING in bench.COVERING_GRID
    assert "guard:moon+ca+gdsf,0%" not in bench.COVERING_GRID  # no lfu, no s3fifo
    for g in bench.COVERING_GRID:
        assert {"mooncake", "cost_aware", "gdsf", "lfu", "s3fifo"} <= set(
            bench.PROTOCOL_GRID[g]["baselines"]
        )
