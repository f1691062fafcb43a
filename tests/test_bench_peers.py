"""scripts/bench_peers.py's memory-bandwidth floor (``--floor``, issue 17): a step of the floor
reads exactly the bytes a decode step must read, and its ratio is jaxkv's time over the
floor's."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np


def _bench_peers():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floor_step_reads_the_weights_and_the_kv_cache():
    bp = _bench_peers()
    cfg = SimpleNamespace(n_layers=3, n_kv_heads=2, head_dim=4)
    params = {"a": np.zeros((5, 6), np.float32), "b": [np.zeros(7, np.float32)]}
    floor = bp.FloorEngine(SimpleNamespace(config=cfg, params=params), kv_bytes=2, threads=2)
    floor.fill(batch=3, ctx=10, room=5)
    # 37 float32 weights; 3 sequences x 10 tokens x (keys and values: 3 layers x 2 heads x 4)
    # numbers of 2 bytes each
    assert sum(p.nbytes for p in floor.cache) == 37 * 4 + 3 * 10 * 2 * (3 * 2 * 4) * 2
    assert len(floor.cache) == 2
    times = floor.decode(3)
    assert len(times) == 3 and min(times) > 0


def test_floor_ratio_is_jaxkv_time_over_the_floor():
    bp = _bench_peers()
    ups = bp.speedups({"floor f32": 0.020, "jaxkv f32 out-first": 0.025, "jaxkv f32": 0.030})
    assert ups["floor f32 vs jaxkv f32 out-first"] == 0.025 / 0.020
    assert ups["floor f32 vs jaxkv f32"] == 0.030 / 0.020
