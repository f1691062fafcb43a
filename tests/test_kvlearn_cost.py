"""KVLearn cost model against hand-computed values and closed forms."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import ModelConfig
from jaxkv.kvlearn.core import cars as cars_lib
from jaxkv.kvlearn.cost import (
    GIB,
    MIB,
    CostModel,
    KVShape,
    cars,
    fit_calibration,
    gamma,
    storage_cost_ms,
)

LLAMA = CostModel.llama3_8b_a100()


def test_footprint_llama3_8b():
    # 2 (K,V) · 32 layers · 8 KV heads · 128 dims · 2 bytes
    assert LLAMA.shape.bytes_per_token == 131_072
    assert LLAMA.footprint_bytes(512) == 64 * MIB
    assert LLAMA.footprint_bytes(576) == 72 * MIB


def test_footprint_from_model_config():
    smol = KVShape.from_model_config(ModelConfig.smollm2_135m())
    assert smol.bytes_per_token == 2 * 30 * 3 * 64 * 4  # float32 by default
    assert (
        KVShape.from_model_config(ModelConfig.mistral_7b_v03(), dtype_bytes=2).bytes_per_token
        == 131_072
    )


def test_recompute_transfer_hand_values():
    assert LLAMA.recompute_ms(100) == pytest.approx(2.6)  # 0.026 · 100, bandwidth-bound
    assert LLAMA.recompute_ms(5000) == pytest.approx(200.0)  # 8e-6 · 5000², compute-bound
    assert LLAMA.crossover_tokens == pytest.approx(3250.0)
    # 64 MiB over 25 GB/s
    assert LLAMA.transfer_ms(64 * MIB) == pytest.approx(64 * 2**20 / 25e9 * 1e3)
    assert LLAMA.transfer_ms(64 * MIB) == pytest.approx(2.68435456)
    assert LLAMA.net_benefit_ms(512) == pytest.approx(0.026 * 512 - 2.68435456)


def test_recompute_is_continuous_and_monotone():
    L = np.arange(1, 20_000, dtype=np.float64)
    r = LLAMA.recompute_ms(L)
    assert np.all(np.diff(r) > 0)
    x = LLAMA.crossover_tokens
    left, right = LLAMA.recompute_ms(x - 1e-6), LLAMA.recompute_ms(x + 1e-6)
    assert abs(right - left) < 1e-6
    # the README's piecewise form jumps at L× = 512; the envelope does not
    assert LLAMA.recompute_ms(511.999) == pytest.approx(LLAMA.recompute_ms(512.001), abs=1e-3)
    # R > T at every length with the A100 / HDR constants
    assert np.all(r > LLAMA.transfer_ms(LLAMA.footprint_bytes(L)))
    # works on traced arrays too
    np.testing.assert_allclose(
        np.asarray(LLAMA.recompute_ms(jnp.asarray(L[:50], jnp.float32))), r[:50], rtol=1e-6
    )


def test_storage_cost_and_cars_closed_form():
    g = gamma(r_bar_ms=10.0, arrival_rate=20.0, capacity_bytes=4 * GIB)
    assert g == pytest.approx(200.0 / (4 * GIB))
    u = storage_cost_ms(
        nbytes=64 * MIB, dt_s=0.05, r_bar_ms=10.0, arrival_rate=20.0, capacity_bytes=4 * GIB
    )
    assert u == pytest.approx(10.0 * 20.0 * 0.05 * (64 / 4096))
    assert cars(p_hat=0.5, net_benefit_ms=10.0, storage_ms=1.0) == pytest.approx(4.0)


def test_density_is_p_minus_pstar_in_bandwidth_regime():
    for tokens in (64, 576, 1440):
        value, nu = cars_lib.score(
            LLAMA,
            p_hat=0.7,
            tokens=tokens,
            r_bar_ms=10.0,
            arrival_rate=20.0,
            capacity_bytes=4 * GIB,
            dt_s=0.05,
        )
        r_minus_t = LLAMA.net_benefit_ms(tokens)
        u = storage_cost_ms(
            nbytes=LLAMA.footprint_bytes(tokens),
            dt_s=0.05,
            r_bar_ms=10.0,
            arrival_rate=20.0,
            capacity_bytes=4 * GIB,
        )
        assert float(value) == pytest.approx(0.7 * r_minus_t - u, rel=1e-5)
        assert float(nu) == pytest.approx(0.7 - u / r_minus_t, rel=1e-5)


def test_fit_calibration_recovers_constants():
    L = np.array([64, 256, 512, 1024, 2048, 4096, 8192, 16384], float)
    a_bw, a_flop = fit_calibration(L, LLAMA.recompute_ms(L))
    assert a_bw == pytest.approx(0.026, rel=1e-9) and a_flop == pytest.approx(8e-6, rel=1e-9)
    with pytest.raises(ValueError):
        fit_calibration([1.0], [1.0])


def test_presets_and_validation():
    assert CostModel.preset("mistral-7b-a100").shape.bytes_per_token == 131_072
    assert CostModel.preset("smollm2-135m-cpu").shape.n_layers == 30
    with pytest.raises(ValueError, match="unknown cost preset"):
        CostModel.preset("gpt-5")
    with pytest.raises(ValueError):
        CostModel(LLAMA.shape, bandwidth_Bps=0)
    with pytest.raises(ValueError):
        KVShape("bad", 0, 1, 1)
    custom = LLAMA.replace(alpha_bw_ms=0.05, bandwidth_Bps=50e9)
    assert custom.recompute_ms(10) == pytest.approx(0.5)
