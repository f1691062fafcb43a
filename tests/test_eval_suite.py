"""The evaluation suite end to end on the tiny model (random weights, byte tokenizer).

Shapes and policy lists are shared between tests so that jit compiles each program once.
"""

import json

import jax
import numpy as np
import pytest

from jaxkv.cli import eval as eval_lib
from jaxkv.cli import suite
from jaxkv.evals import fidelity, report, runner
from jaxkv.eviction import Compression
from jaxkv.generate import generate_tokens, teacher_forced
from jaxkv.model import cache_kernel
from jaxkv.policies import get_policy
from jaxkv.policies.learned import init_mlp, learned_policy

HEURISTICS = "random,streaming_llm,h2o,snapkv,tova,keydiff,knorm"
TINY = ["--model", "tiny", "--min-budget", "8", "--batch", "2"]
WINDOWS = ["--window", "96", "--prompt-len", "64"]
GEN = [*TINY, "--policies", "full,random,h2o", "--ratios", "0.5", "--seeds", "0,1"]


@pytest.fixture(scope="module")
def model():
    return runner.load_eval_model("tiny")


def _run(args, tmp_path, capsys=None):
    status = eval_lib.main([*args, "--out", str(tmp_path)])
    return status


def _load(tmp_path, name):
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert doc["model"] == "tiny"
    assert (tmp_path / f"{name}.md").read_text().startswith("# ")
    return doc


# ----------------------------------------------------------------------------------------------
# The switch policy: one compiled program for several policies, same results as each alone


def test_switch_policy_reproduces_each_member_alone(model):
    members = [get_policy("random"), learned_policy(init_mlp(key=jax.random.key(2)))]
    switch = runner.switch_policy(members)
    tokens = jax.random.randint(jax.random.key(1), (2, 80), 1, 256)
    comp = runner.switch_compression(switch, ratio=0.3, min_budget=8)
    for i, member in enumerate(members):
        got, _ = teacher_forced(
            model.params,
            tokens,
            prompt_len=40,
            config=model.config,
            compression=comp,
            policy_state=runner.switch_state(members, i),
            key=jax.random.key(3),
        )
        alone = Compression(policy=member, ratio=0.3, min_budget=8)
        want, _ = teacher_forced(
            model.params,
            tokens,
            prompt_len=40,
            config=model.config,
            compression=alone,
            key=jax.random.key(3),
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    prompts = [list(range(1, 50)), list(range(9, 30))]
    got = generate_tokens(
        model.params,
        prompts,
        config=model.config,
        max_new_tokens=6,
        compression=comp,
        policy_state=runner.switch_state(members, 0),
    )
    alone = Compression(policy=members[0], ratio=0.3, min_budget=8)
    assert got == generate_tokens(
        model.params, prompts, config=model.config, max_new_tokens=6, compression=alone
    )


def test_switch_policy_reproduces_each_member_under_prefill_and_adaptive(model):
    members = [g.members[0] for g in runner.parse_policies("tova,critical:h2o")]
    switch = runner.switch_policy(members, granularity="adaptive")
    comp = runner.switch_compression(
        switch, ratio=0.3, min_budget=8, protocol="prefill", granularity="adaptive"
    )
    assert comp.granularity == "adaptive" and comp.protocol == "prefill"
    tokens = jax.random.randint(jax.random.key(1), (2, 80), 1, 256)
    for i, member in enumerate(members):
        got, _ = teacher_forced(
            model.params,
            tokens,
            prompt_len=40,
            config=model.config,
            compression=comp,
            policy_state=runner.switch_state(members, i),
        )
        alone = Compression(
            policy=member, ratio=0.3, min_budget=8, granularity="adaptive", protocol="prefill"
        )
        want, _ = teacher_forced(
            model.params, tokens, prompt_len=40, config=model.config, compression=alone
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_switch_policy_rejects_full_and_parse_errors_are_clear():
    with pytest.raises(ValueError, match="never evicts"):
        runner.switch_policy([get_policy("full")])
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        runner.parse_policies("h2o,nope")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        runner.parse_ratios("0.5,1.5")
    with pytest.raises(ValueError, match="twice"):
        runner.parse_policies("h2o,h2o")
    groups = runner.parse_policies("full,random,h2o")
    assert [g.is_full for g in groups] == [True, False, False]
    assert len(groups[1].runs([0, 1, 2])) == 3 and len(groups[2].runs([0, 1, 2])) == 1


# ----------------------------------------------------------------------------------------------
# fidelity


def test_fidelity_end_to_end_and_ratio_one_is_the_full_cache_exactly(tmp_path):
    args = ["fidelity", *TINY, *WINDOWS, "--limit", "2", "--ratios", "1,0.5"]
    args += ["--policies", "full," + HEURISTICS, "--seeds", "0,1"]
    assert _run(args, tmp_path) == 0
    doc = _load(tmp_path, "fidelity")
    assert doc["complete"] is True
    rows = doc["results"]
    assert {(r["policy"], r["ratio"]) for r in rows} == {
        (p, r) for p in ["full", *HEURISTICS.split(",")] for r in (1.0, 0.5)
    }
    keys = {"policy", "ratio", "kl_mean", "kl_std", "ppl", "ppl_full", "ppl_increase"}
    for row in rows:
        assert keys <= set(row)
        if row["ratio"] == 1.0:
            assert row["kl_mean"] == 0.0 and row["kl_std"] == 0.0
            assert row["ppl"] == row["ppl_full"] and row["ppl_increase"] == 0.0
        elif row["policy"] != "full":
            assert row["kl_mean"] > 0.0
    random_half = next(r for r in rows if r["policy"] == "random" and r["ratio"] == 0.5)
    assert random_half["n_seeds"] == 2 and random_half["kl_std"] > 0.0
    assert (tmp_path / "fidelity_ppl.png").stat().st_size > 0
    assert (tmp_path / "fidelity_kl.png").stat().st_size > 0


def test_fidelity_under_prefill_and_adaptive_with_the_oracle_and_critical(tmp_path):
    args = ["fidelity", *TINY, *WINDOWS, "--limit", "2", "--ratios", "1,0.5", "--seeds", "0"]
    args += ["--policies", "full,h2o,critical:tova,oracle", "--protocol", "prefill"]
    assert _run([*args, "--granularity", "adaptive"], tmp_path) == 0
    doc = _load(tmp_path, "fidelity")
    assert doc["config"]["protocol"] == "prefill" and doc["config"]["granularity"] == "adaptive"
    rows = {(r["policy"], r["ratio"]): r for r in doc["results"]}
    assert set(rows) == {
        (p, r) for p in ("full", "h2o", "critical:tova", "oracle") for r in (1, 0.5)
    }
    for policy in ("h2o", "critical:tova", "oracle"):
        assert rows[(policy, 1.0)]["kl_mean"] == 0.0
        assert rows[(policy, 0.5)]["kl_mean"] > 0.0
    assert rows[("oracle", 0.5)]["kl_mean"] < rows[("h2o", 0.5)]["kl_mean"]


def test_a_row_with_its_own_granularity_equals_a_run_with_it(tmp_path):
    """``h2o@head`` and ``critical:snapkv@global`` beside ``tova`` at the run's ``layer``: each
    row's per-window KL equals a run of that policy alone at that ``--granularity``, and the
    per-head bounds apply to the pooled row only."""
    base = ["fidelity", *TINY, *WINDOWS, "--limit", "2", "--ratios", "0.5", "--seeds", "0"]
    policies = "full,h2o@head,tova,critical:snapkv@global"
    mixed = [*base, "--policies", policies, "--granularity", "layer", "--head-floor", "0"]
    assert _run(mixed, tmp_path / "mixed") == 0
    rows = {r["policy"]: r for r in _load(tmp_path / "mixed", "fidelity")["records"]}
    assert set(rows) == {"full", "h2o@head", "tova", "critical:snapkv@global"}
    alone = [
        ("h2o@head", ["h2o", "--granularity", "head"]),
        ("tova", ["tova", "--granularity", "layer"]),
        (
            "critical:snapkv@global",
            ["critical:snapkv", "--granularity", "global", "--head-floor", "0"],
        ),
    ]
    for i, (label, flags) in enumerate(alone):
        assert _run([*base, "--policies", *flags], tmp_path / str(i)) == 0
        (record,) = _load(tmp_path / str(i), "fidelity")["records"]
        assert rows[label]["kl_per_window"] == record["kl_per_window"]
        assert rows[label]["kl_mean"] > 0.0


def test_policy_items_parse_a_granularity_suffix():
    groups = runner.parse_policies("h2o@head,rerank@0.5:h2o,critical:tova@global,snapkv")
    assert [(g.label, g.granularity) for g in groups] == [
        ("h2o@head", "head"),
        ("rerank@0.5:h2o", None),
        ("critical:tova@global", "global"),
        ("snapkv", None),
    ]
    assert [g.selection("layer") for g in groups] == ["head", "layer", "global", "layer"]
    with pytest.raises(ValueError, match="full cache keeps every token"):
        runner.parse_policies("full@head")


def test_learned_checkpoint_seeds_give_mean_and_std(model, tmp_path):
    seeds = tuple(
        learned_policy(init_mlp(key=jax.random.key(k)), name=f"l{k}", spec=(k,)) for k in (0, 1)
    )
    store = report.ResultStore(
        tmp_path,
        "fid",
        model="tiny",
        config={},
        summarize=fidelity.summarize,
        render=fidelity.render,
    )
    windows = np.asarray(jax.random.randint(jax.random.key(0), (2, 96), 1, 256))
    rows = fidelity.run(
        model,
        [runner.PolicyGroup("learned", seeds)],
        ratios=[0.5],
        seeds=[0],
        windows_NT=windows,
        settings=fidelity.FidelitySettings(prompt_len=64, batch_size=2, min_budget=8),
        store=store,
    )
    assert rows[0]["n_seeds"] == 2 and rows[0]["kl_std"] > 0


def test_partial_results_are_kept_when_a_run_stops(tmp_path, monkeypatch):
    calls = []
    real = fidelity._scores

    def failing(*a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(fidelity, "_scores", failing)
    args = ["fidelity", *TINY, *WINDOWS, "--limit", "2", "--ratios", "0.5"]
    assert _run([*args, "--policies", "full,h2o,snapkv,tova"], tmp_path) == 130
    doc = json.loads((tmp_path / "fidelity.json").read_text())
    assert doc["complete"] is False
    assert [r["policy"] for r in doc["records"]] == ["full", "h2o"]
    assert "Partial results" in (tmp_path / "fidelity.md").read_text()


# ----------------------------------------------------------------------------------------------
# positions, latency


def test_positions_end_to_end(tmp_path):
    args = ["positions", *TINY, *WINDOWS, "--limit", "2", "--ratios", "0.5", "--seeds", "0"]
    assert _run([*args, "--policies", HEURISTICS], tmp_path) == 0
    rows = _load(tmp_path, "positions")["results"]
    by = {r["policy"]: r for r in rows}
    assert set(by) == set(HEURISTICS.split(","))
    for r in rows:
        assert np.isclose(np.sum(r["density"]) / len(r["density"]), 1.0)
        assert np.isclose(r["first_10pct"] + r["middle_80pct"] + r["last_10pct"], 1.0)
        assert r["kept_per_row"] == 47  # floor(0.5 * 95 tokens fed: the last one predicts nothing)
    assert by["streaming_llm"]["last_10pct"] > by["random"]["last_10pct"]
    assert (tmp_path / "positions_r0.5.png").exists()


def test_latency_end_to_end(tmp_path):
    args = ["latency", "--model", "tiny", "--context", "64", "--new-tokens", "4"]
    args += ["--repeats", "1", "--ratios", "0.5", "--policies", "full,h2o", "--limit", "2"]
    assert _run(args, tmp_path) == 0
    rows = _load(tmp_path, "latency")["results"]
    assert [r["policy"] for r in rows] == ["full", "h2o"]
    assert rows[0]["feature_ms"] is None and rows[1]["policy_ms"] > 0
    assert all(r["attn_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["capacity"] < rows[0]["capacity"]


def test_latency_through_the_attention_kernel(tmp_path, monkeypatch):
    """``--attention kernel`` reaches the model (``config.attention``) and the result file."""
    if not cache_kernel.available():
        pytest.skip(f"no attention kernel here: {cache_kernel.unavailable_reason()}")
    loaded, load = [], runner.load_eval_model

    def spy(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(runner, "load_eval_model", spy)
    args = ["latency", "--model", "tiny", "--context", "64", "--new-tokens", "4", "--repeats"]
    args += ["1", "--ratios", "0.5", "--policies", "full,h2o", "--limit", "2"]
    assert _run([*args, "--attention", "kernel"], tmp_path) == 0
    doc = _load(tmp_path, "latency")
    assert doc["config"]["attention"] == "kernel"
    assert [r["policy"] for r in doc["results"]] == ["full", "h2o"]
    assert [m.config.attention for m in loaded] == ["kernel"]


def test_an_unavailable_kernel_fails_before_any_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cache_kernel, "_load", lambda: (False, "no C++ compiler"))
    out = tmp_path / "run"
    args = ["fidelity", "--model", "tiny", "--attention", "kernel", "--out", str(out)]
    assert eval_lib.main(args) == 2
    assert "no C++ compiler" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# generation tasks


def test_retrieval_end_to_end(tmp_path):
    args = ["retrieval", *GEN, "--limit", "2", "--lengths", "512", "--tasks", "passkey,needle"]
    assert _run(args, tmp_path) == 0
    rows = _load(tmp_path, "retrieval")["results"]
    tasks = {r["task"] for r in rows}
    assert tasks == {"passkey/512", "needle/512"}
    random_row = next(r for r in rows if r["policy"] == "random")
    assert random_row["n_seeds"] == 2 and random_row["n_examples"] == 2
    assert all(0 <= r["score"] <= 100 for r in rows)


def test_gsm8k_and_agreement_end_to_end(tmp_path):
    args = ["gsm8k", *GEN, "--limit", "2", "--shots", "1", "--max-new-tokens", "8"]
    args += ["--policies", "full,random,h2o,critical:h2o"]  # critical: runs in every command
    assert _run(args, tmp_path) == 0
    doc = _load(tmp_path, "gsm8k")
    assert {(r["policy"], r["ratio"]) for r in doc["results"]} == {
        ("full", 1.0),
        ("random", 0.5),
        ("h2o", 0.5),
        ("critical:h2o", 0.5),
    }
    assert all(r["n_tokens"] <= 8 for r in doc["records"])
    args = ["agreement", *GEN, "--task", "bbh/sports_understanding", "--limit", "2"]
    assert _run([*args, "--max-new-tokens", "8"], tmp_path) == 0
    rows = _load(tmp_path, "agreement")["results"]
    assert {r["policy"] for r in rows} == {"random", "h2o"}
    for r in rows:
        assert 0 <= r["rouge_l"] <= 1 and 0 <= r["exact_match"] <= 1 and r["length_ratio"] > 0


def _completions_at(records, ratio):
    """(policy, task, id) -> completion of the records at ``ratio`` (the full cache's at 1)."""
    return {
        (r["policy"], r["task"], r["id"]): r["completion"] for r in records if r["ratio"] == ratio
    }


def _assert_ratio_one_is_the_full_cache(records, policies):
    at_one = _completions_at(records, 1.0)
    full = {(t, i): c for (p, t, i), c in at_one.items() if p == "full"}
    assert full
    for policy in policies:
        assert {(t, i): c for (p, t, i), c in at_one.items() if p == policy} == full


def test_retrieval_under_prefill_and_ratio_one_is_the_full_cache(tmp_path):
    args = ["retrieval", *TINY, "--policies", "full,h2o,snapkv", "--ratios", "1,0.25"]
    args += ["--seeds", "0", "--limit", "2", "--lengths", "256", "--tasks", "passkey"]
    assert _run([*args, "--protocol", "prefill"], tmp_path) == 0
    doc = _load(tmp_path, "retrieval")
    assert doc["config"]["protocol"] == "prefill" and "granularity" not in doc["config"]
    assert {(r["policy"], r["ratio"]) for r in doc["results"]} == {
        ("full", 1.0),
        *((p, r) for p in ("h2o", "snapkv") for r in (1.0, 0.25)),
    }
    _assert_ratio_one_is_the_full_cache(doc["records"], ("h2o", "snapkv"))
    assert _run(args, tmp_path / "decode") == 0  # the protocol reaches the compression
    decode = _load(tmp_path / "decode", "retrieval")
    assert "protocol" not in decode["config"]
    assert _completions_at(decode["records"], 0.25) != _completions_at(doc["records"], 0.25)


def test_retrieval_per_head_bounds_reach_the_compression(tmp_path):
    """``--granularity global`` with every head held to exactly B (floor = cap = 1) keeps each
    row's own top B, as ``--granularity head`` does: the same completions; the default bounds
    (0.2, 2) let rows trade budget and answer otherwise. The bounds are recorded only when
    given."""
    args = ["retrieval", *TINY, "--policies", "full,h2o,tova", "--ratios", "0.25", "--seeds", "0"]
    args += ["--limit", "2", "--lengths", "512", "--tasks", "passkey,needle"]
    runs = {
        "head": ["--granularity", "head"],
        "held": ["--granularity", "global", "--head-floor", "1", "--head-cap", "1"],
        "pooled": ["--granularity", "global"],
    }
    docs = {}
    for name, flags in runs.items():
        assert _run([*args, *flags], tmp_path / name) == 0
        docs[name] = _load(tmp_path / name, "retrieval")
    assert docs["held"]["config"]["head_floor"] == 1.0 and docs["held"]["config"]["head_cap"] == 1.0
    assert "head_floor" not in docs["pooled"]["config"] and "head_cap" not in docs["head"]["config"]
    head, held, pooled = (_completions_at(docs[n]["records"], 0.25) for n in runs)
    assert set(held) == set(head) and {p for p, _, _ in held} == {"h2o", "tova"}
    assert held == head
    assert held != pooled


@pytest.mark.parametrize(
    "selection",
    [[], ["--protocol", "prefill"], ["--protocol", "prefill", "--granularity", "adaptive"]],
)
def test_agreement_ratio_one_is_the_full_cache_in_both_protocols(selection, tmp_path):
    args = ["agreement", *TINY, "--policies", "h2o,tova", "--ratios", "1,0.25", "--seeds", "0"]
    args += ["--task", "gsm8k", "--limit", "2", "--max-new-tokens", "12", *selection]
    assert _run(args, tmp_path) == 0
    doc = _load(tmp_path, "agreement")
    given = dict(zip(selection[::2], selection[1::2], strict=True))
    assert {k: doc["config"].get(k) for k in ("protocol", "granularity")} == {
        "protocol": given.get("--protocol"),
        "granularity": given.get("--granularity"),
    }
    _assert_ratio_one_is_the_full_cache(doc["records"], ("h2o", "tova"))
    rows = {(r["policy"], r["ratio"]): r for r in doc["results"]}
    for policy in ("h2o", "tova"):
        assert rows[(policy, 1.0)]["exact_match"] == 1.0
        assert rows[(policy, 1.0)]["rouge_l"] == 1.0
    # at r = 0.25 the budget (B_min = 8) is below the prompts, so the policies do evict
    assert any(rows[(p, 0.25)]["exact_match"] < 1.0 for p in ("h2o", "tova"))


def test_bbh_end_to_end(tmp_path):
    args = ["bbh", *GEN, "--tasks", "sports_understanding", "--limit", "2"]
    assert _run([*args, "--max-new-tokens", "8"], tmp_path) == 0
    rows = _load(tmp_path, "bbh")["results"]
    assert {r["task"] for r in rows} == {"bbh/sports_understanding"}


def _longbench_line(i, context="The capital of France is Paris. " * 4):
    return json.dumps(
        {
            "_id": f"q{i}",
            "input": "What is the capital of France?",
            "context": context,
            "answers": ["Paris"],
            "length": 30,
            "all_classes": None,
        }
    )


def test_longbench_end_to_end_and_malformed_line_keeps_partial_results(tmp_path, capsys):
    good = tmp_path / "hotpotqa.jsonl"
    good.write_text("\n".join(_longbench_line(i) for i in range(2)) + "\n")
    args = ["longbench", *GEN, "--data", str(good), "--max-new-tokens", "8", "--batch", "1"]
    assert _run(args, tmp_path / "ok") == 0
    rows = _load(tmp_path / "ok", "longbench")["results"]
    assert {r["task"] for r in rows} == {"longbench/hotpotqa"}
    assert all(r["n_examples"] == 2 for r in rows)

    bad = tmp_path / "bad" / "hotpotqa.jsonl"
    bad.parent.mkdir()
    bad.write_text(_longbench_line(0) + "\n{not json\n")
    args = ["longbench", *GEN, "--data", str(bad), "--max-new-tokens", "8", "--batch", "1"]
    assert _run(args, tmp_path / "bad_out") == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: malformed JSON line" in err and "kept in" in err
    doc = json.loads((tmp_path / "bad_out" / "longbench.json").read_text())
    assert doc["complete"] is False
    assert {r["id"] for r in doc["records"]} == {"q0"} and len(doc["records"]) == 4


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "args, message",
    [
        (["fidelity", "--text", "/nonexistent/text.txt"], "data file not found: /nonexistent"),
        (["bbh", "--tasks", "no_such_task"], "unknown BBH task 'no_such_task'"),
        (["retrieval", "--tasks", "passkey,haystack"], "unknown retrieval task 'haystack'"),
        (["agreement", "--task", "trivia"], "unknown agreement task 'trivia'"),
        (["longbench", "--data", "/nonexistent.jsonl"], "data file not found"),
        (["fidelity", "--policies", "h2o,bogus"], "unknown policy 'bogus'"),
        (["fidelity", "--policies", "learned:/nonexistent/ckpt"], "learned"),
        (["fidelity", "--ratios", "0"], "--ratios must lie in (0, 1]"),
        (
            ["fidelity", "--policies", "learned:distillcache_smollm2_cpu", "--granularity", "head"],
            "does not support granularity 'head'",
        ),
        (["positions", "--policies", "h2o,oracle"], "oracle policy needs"),
        (["retrieval", "--policies", "h2o@head"], "h2o@head: a granularity of its own"),
        (["fidelity", "--policies", "h2o@layer", "--head-cap", "2"], "only with --granularity"),
        (["retrieval", "--head-floor", "0.5"], "--head-floor: only with --granularity"),
    ],
)
def test_bad_input_gives_a_clear_error(args, message, tmp_path, capsys):
    assert _run([*args, "--model", "tiny"], tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_empty_text_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert _run(["fidelity", "--model", "tiny", "--text", str(empty)], tmp_path) == 2
    assert "the text is empty" in capsys.readouterr().err


def test_default_job_and_subcommands():
    assert set(suite.SUBCOMMANDS) == {
        "fidelity",
        "retrieval",
        "gsm8k",
        "bbh",
        "longbench",
        "agreement",
        "positions",
        "latency",
    }
    args = eval_lib.build_parser().parse_args(suite.DEFAULT_JOB)
    assert args.command == "fidelity" and args.ratios == "0.25,0.125"
    assert args.model == "smollm2-135m" and args.out is None  # a new runs/fidelity-<time>/
    assert set(args.policies.split(",")) == {
        "full",
        "streaming_llm",
        "h2o",
        "snapkv",
        "tova",
        "learned:distillcache_smollm2_cpu",
    }


def test_fidelity_evicts_every_k_steps_when_asked(tmp_path):
    """``--evict-every k``: the recorded setting, the same KL as the library's loop at that
    period, and r = 1 still the full cache."""
    args = ["fidelity", *TINY, *WINDOWS, "--limit", "2", "--policies", "full,h2o"]
    assert _run([*args, "--ratios", "1,0.5", "--evict-every", "8"], tmp_path / "k8") == 0
    doc = _load(tmp_path / "k8", "fidelity")
    assert doc["config"]["evict_every"] == 8
    kl = {(r["policy"], r["ratio"]): r["kl_mean"] for r in doc["results"]}
    assert kl[("h2o", 1.0)] == 0.0 and kl[("h2o", 0.5)] > 0.0
    assert _run([*args, "--ratios", "0.5"], tmp_path / "k1") == 0
    one = {r["policy"]: r["kl_mean"] for r in _load(tmp_path / "k1", "fidelity")["results"]}
    assert one["h2o"] != kl[("h2o", 0.5)]  # evicting less often keeps other tokens
