"""The joint table of scripts/compare_kvpress.sh (merging only: no kvpress, no torch)."""

import importlib.util
from pathlib import Path

import numpy as np

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_kvpress_table.py"
_spec = importlib.util.spec_from_file_location("compare_kvpress_table", _SCRIPT)
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def _jaxkv(policy, ratio, kl):
    return {
        "policy": policy,
        "ratio": ratio,
        "kl_mean": kl,
        "ppl": 11.0,
        "ppl_full": 10.0,
        "top1_agreement": 0.5,
    }


def _kvpress(method, ratio, kl):
    return {
        "method": method,
        "ratio": ratio,
        "kl_mean": kl,
        "ppl": 12.0,
        "ppl_full": 10.0,
        "top1_agreement": 0.25,
        "defaults": "n_sink=4",
    }


def test_merge_sorts_by_kl_at_the_first_ratio_and_marks_the_oracle():
    rows = table.jaxkv_rows(
        [
            _jaxkv("full", 0.25, 0.0),
            _jaxkv("h2o", 0.25, 0.3),
            _jaxkv("h2o", 0.125, 0.5),
            _jaxkv("oracle", 0.25, 0.05),
            _jaxkv("oracle", 0.125, 0.1),
        ],
        "head",
    ) + table.kvpress_rows(
        [
            _kvpress("StreamingLLMPress", 0.25, 0.2),
            _kvpress("StreamingLLMPress", 0.125, 0.6),
            _kvpress("KnormPress", 0.125, 0.01),
        ]
    )
    entries = table.merge(rows, [0.25, 0.125])
    assert [(e["side"], e["method"]) for e in entries] == [
        ("jaxkv", "oracle"),
        ("kvpress", "StreamingLLMPress"),
        ("jaxkv", "h2o"),
        ("kvpress", "KnormPress"),  # no r = 0.25 row: last
    ]
    assert [e["upper_bound"] for e in entries] == [True, False, False, False]
    assert entries[1]["granularity"] == "same positions everywhere"
    assert entries[2]["kl"] == {"0.25": 0.3, "0.125": 0.5}
    np.testing.assert_allclose(entries[2]["ppl_increase"]["0.25"], 1.0)
    md = table.render(
        entries,
        [],
        ratios=[0.25, 0.125],
        meta={"text": "t", "heldout": 1, "windows": 1, "window": 384, "prompt_len": 256},
    )
    assert "**oracle (upper bound)**" in md
    assert "| StreamingLLMPress | n_sink=4 |" in md


def test_kept_agreement_counts_shared_positions_per_row():
    ours = np.zeros((2, 1, 2, 8), bool)  # [N, L, K, P]
    ours[..., :4] = True
    theirs0 = np.zeros((1, 2, 8), bool)
    theirs0[..., :4] = True  # identical in window 0
    theirs1 = np.zeros((1, 2, 8), bool)
    theirs1[:, 0, :4] = True
    theirs1[:, 1, 2:6] = True  # head 1 of window 1 shares half
    agreement = table.kept_agreement(
        {"kept/knorm/head/0.25": ours},
        {"kept/KnormPress/0.25/1": theirs1, "kept/KnormPress/0.25/0": theirs0},
        [0.25],
    )
    assert len(agreement) == 1
    np.testing.assert_allclose(agreement[0]["overlap"], (1 + 1 + 1 + 0.5) / 4)
    np.testing.assert_allclose(agreement[0]["identical_rows"], 3 / 4)
