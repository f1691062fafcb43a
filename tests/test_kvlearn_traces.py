"""Zipf multimodal workload, JSONL trace format and loader validation."""

import json

import numpy as np
import pytest

from jaxkv import data as data_lib
from jaxkv.kvlearn import traces as T

MOONCAKE = data_lib.data_file(data_lib.MOONCAKE_EXAMPLE)


def test_catalog_matches_readme_workload():
    cat = T.zipf_catalog(1.1)
    assert len(cat.names) == 130
    text, image, video = (cat.tokens[cat.modality == m] for m in (T.TEXT, T.IMAGE, T.VIDEO))
    assert text.min() == 64 and text.max() == 288 and len(text) == 40
    assert np.all(image == 576) and len(image) == 80
    assert video.min() == 720 and video.max() == 1440 and len(video) == 10
    assert cat.popularity.sum() == pytest.approx(1.0)
    # Zipf over ranks with modality factors 0.6 / 1.4 / 1.1
    w = np.array([0.6] * 40 + [1.4] * 80 + [1.1] * 10) / np.arange(1, 131) ** 1.1
    np.testing.assert_allclose(cat.popularity, w / w.sum())


def test_trace_is_seeded_and_follows_popularity():
    a = T.zipf_multimodal(20_000, 0.8, seed=3)
    b = T.zipf_multimodal(20_000, 0.8, seed=3)
    c = T.zipf_multimodal(20_000, 0.8, seed=4)
    np.testing.assert_array_equal(a.key, b.key)
    assert not np.array_equal(a.key, c.key)
    np.testing.assert_allclose(np.diff(a.time_s), 0.05)  # 20 requests/s
    freq = a.empirical_popularity()
    se = np.sqrt(a.popularity * (1 - a.popularity) / 20_000)
    assert np.all(np.abs(freq - a.popularity) < 5 * se + 1e-9)
    assert np.all(a.tokens == T.zipf_catalog(0.8).tokens[a.key])
    p = T.zipf_multimodal(2000, 0.8, seed=3, poisson=True)
    assert np.all(np.diff(p.time_s) > 0) and abs(p.time_s[-1] / 2000 - 0.05) < 0.01


def test_next_use_index_brute_force():
    key = np.random.default_rng(0).integers(0, 7, 300)
    nxt = T.next_use_index(key)
    for i in range(300):
        later = [j for j in range(i + 1, 300) if key[j] == key[i]]
        assert nxt[i] == (later[0] if later else 300)


def test_jsonl_roundtrip(tmp_path):
    tr = T.zipf_multimodal(500, 1.1, seed=1)
    path = tmp_path / "t.jsonl"
    T.save_jsonl(tr, path)
    back = T.load_jsonl(path)
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
    with pytest.raises(T.TraceError, match=f"bad.jsonl:3: {message}"):
        T.load_jsonl(path)


def test_loader_missing_and_empty(tmp_path):
    with pytest.raises(T.TraceError, match="not found"):
        T.load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(T.TraceError, match="no requests"):
        T.load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(T.TraceError, match="alpha"):
        T.zipf_multimodal(10, 0.0, seed=0)
    with pytest.raises(T.TraceError, match="n_requests"):
        T.zipf_multimodal(0, 1.1, seed=0)


def test_mooncake_blocks(tmp_path):
    path = tmp_path / "mc.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tr = T.load_mooncake(path)
    assert [tr.names[k] for k in tr.key] == ["mc/1", "mc/2", "mc/3", "mc/1", "mc/2"]
    np.testing.assert_array_equal(tr.tokens, [512, 512, 76, 512, 512])
    np.testing.assert_allclose(tr.time_s, [0, 0, 0, 0.5, 0.5])
    path.write_text(json.dumps(rows[0] | {"hash_ids": [1]}) + "\n")
    with pytest.raises(T.TraceError, match="mc.jsonl:1: 1 hash_ids for input_length 1100"):
        T.load_mooncake(path)


def test_real_mooncake_trace_loads():
    tr = T.load_mooncake(MOONCAKE)
    assert len(tr) == 121_877
    reuse = 1 - tr.n_keys / len(tr)
    assert 0.5 < reuse < 0.8  # the data README states 64 % block reuse


def test_real_mooncake_trace_loads_exactly_as_before():
    """Digest of the block trace of the shipped example, computed with the loader before the
    two Mooncake loaders became one: the strict loader changed nothing on valid files."""
    import hashlib

    tr = T.load_mooncake(MOONCAKE)
    h = hashlib.sha256()
    for a in (tr.key, tr.tokens, tr.modality, tr.time_s):
        h.update(a.dtype.str.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    h.update("\n".join(tr.names).encode())
    assert h.hexdigest() == "ab11e5882d942bb5a76308be64bf200e0b090b6c49e2a5810ec7ef9f9dac235f"
