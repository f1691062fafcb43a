"""Trace types and formats: JSONL and Mooncake loaders and their validation."""

import hashlib
import json

import numpy as np
import pytest

from jaxkv import data as data_lib
from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn import workloads

MOONCAKE = data_lib.data_file(data_lib.MOONCAKE_EXAMPLE)


def test_next_use_index_brute_force():
    key = np.random.default_rng(0).integers(0, 7, 300)
    nxt = traces_lib.next_use_index(key)
    for i in range(300):
        later = [j for j in range(i + 1, 300) if key[j] == key[i]]
        assert nxt[i] == (later[0] if later else 300)


def test_jsonl_roundtrip(tmp_path):
    tr = workloads.zipf_multimodal(500, 1.1, seed=1)
    path = tmp_path / "t.jsonl"
    traces_lib.save_jsonl(tr, path)
    back = traces_lib.load_jsonl(path)
    assert [back.names[k] for k in back.key] == [tr.names[k] for k in tr.key]
    np.testing.assert_array_equal(back.tokens, tr.tokens)
    np.testing.assert_array_equal(back.modality, tr.modality)
    np.testing.assert_allclose(back.time_s, tr.time_s)


GOOD = {"t": 0.5, "key": "img/1", "tokens": 576, "modality": "image"}


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            json.dumps({k: v for k, v in GOOD.items() if k != "tokens"}),
            "missing fields \\['tokens'\\]",
        ),
        (json.dumps(GOOD | {"extra": 1}), "unknown fields \\['extra'\\]"),
        (json.dumps(GOOD | {"key": ""}), "'key' must be a non-empty string"),
        (json.dumps(GOOD | {"tokens": 0}), "'tokens' must be an integer > 0"),
        (json.dumps(GOOD | {"tokens": 5.5}), "'tokens' must be an integer > 0"),
        (json.dumps(GOOD | {"tokens": True}), "'tokens' must be an integer > 0"),
        (json.dumps(GOOD | {"modality": "audio"}), "'modality' must be one of"),
        (json.dumps(GOOD | {"t": -1}), "'t' must be a finite number"),
        (json.dumps(GOOD | {"t": "3"}), "'t' must be a finite number"),
        (json.dumps(GOOD | {"t": 0.1}), "time 0.1 goes backwards"),
        (json.dumps(GOOD | {"t": 1.0, "tokens": 500}), "key 'img/1' changed"),
    ],
)
def test_loader_names_the_bad_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad + "\n")
    with pytest.raises(traces_lib.TraceError, match=f"bad.jsonl:3: {message}"):
        traces_lib.load_jsonl(path)


def test_loader_missing_and_empty(tmp_path):
    with pytest.raises(traces_lib.TraceError, match="not found"):
        traces_lib.load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(traces_lib.TraceError, match="no requests"):
        traces_lib.load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(traces_lib.TraceError, match="alpha"):
        workloads.zipf_multimodal(10, 0.0, seed=0)
    with pytest.raises(traces_lib.TraceError, match="n_requests"):
        workloads.zipf_multimodal(0, 1.1, seed=0)


def test_mooncake_blocks(tmp_path):
    path = tmp_path / "mc.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tr = traces_lib.load_mooncake(path)
    assert [tr.names[k] for k in tr.key] == ["mc/1", "mc/2", "mc/3", "mc/1", "mc/2"]
    np.testing.assert_array_equal(tr.tokens, [512, 512, 76, 512, 512])
    np.testing.assert_allclose(tr.time_s, [0, 0, 0, 0.5, 0.5])
    path.write_text(json.dumps(rows[0] | {"hash_ids": [1]}) + "\n")
    with pytest.raises(traces_lib.TraceError, match="mc.jsonl:1: 1 hash_ids for input_length 1100"):
        traces_lib.load_mooncake(path)


def test_real_mooncake_trace_loads():
    tr = traces_lib.load_mooncake(MOONCAKE)
    assert len(tr) == 121_877
    reuse = 1 - tr.n_keys / len(tr)
    assert 0.5 < reuse < 0.8  # the data README states 64 % block reuse


def test_real_mooncake_trace_loads_exactly_as_before():
    """Digest of the block trace of the shipped example, computed with the loader before the
    two Mooncake loaders became one: the strict loader changed nothing on valid files."""
    tr = traces_lib.load_mooncake(MOONCAKE)
    h = hashlib.sha256()
    for a in (tr.key, tr.tokens, tr.modality, tr.time_s):
        h.update(a.dtype.str.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    h.update("\n".join(tr.names).encode())
    assert h.hexdigest() == "ab11e5882d942bb5a76308be64bf200e0b090b6c49e2a5810ec7ef9f9dac235f"


def test_a_mooncake_file_is_not_read_as_the_jsonl_format(tmp_path):
    path = tmp_path / "mc.jsonl"
    row = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(traces_lib.TraceError, match="mc.jsonl:1: a Mooncake record"):
        traces_lib.load_jsonl(path)
    assert len(traces_lib.load_mooncake_trace(path)) == 1


def test_save_mooncake_jsonl_round_trips(tmp_path):
    recs = [
        {"timestamp": 0.5, "input_length": 600, "output_length": 3, "hash_ids": [4, 9], "turn": 0},
        {"timestamp": 2.0, "input_length": 512, "output_length": 1, "hash_ids": [4]},
    ]
    traces_lib.save_mooncake_jsonl(recs, tmp_path / "sub" / "mc.jsonl")
    tr = traces_lib.load_mooncake_trace(tmp_path / "sub" / "mc.jsonl")
    assert tr.hashes == (4, 9) and tr.n_blocks == 2
    np.testing.assert_array_equal(tr.input_len, [600, 512])
    np.testing.assert_allclose(tr.time_s, [0.5e-3, 2e-3])
