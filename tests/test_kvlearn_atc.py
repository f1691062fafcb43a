"""ATC: rises under sustained pressure, falls with room, no windup, regulates ρ to ρ*."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kvlearn.core import atc as atc_lib

CFG = atc_lib.ATCConfig()


def _run(state, rhos, hit_rate=0.9):
    def step(s, rho):
        s = atc_lib.update(s.replace(hit_rate=jnp.float32(hit_rate)), rho=rho, cfg=CFG)
        return s, s.theta

    return jax.lax.scan(step, state, jnp.asarray(rhos, jnp.float32))


def test_theta_rises_under_pressure_and_saturates_at_clamp():
    state, theta = _run(atc_lib.init_atc(CFG), np.ones(20_000))
    theta = np.asarray(theta)
    assert np.all(np.diff(theta) >= 0) and theta[0] > CFG.theta0
    assert theta[-1] == pytest.approx(CFG.theta_max, abs=1e-3)
    assert CFG.ki * float(state.integral) <= CFG.theta_max - CFG.theta0 + 1e-6


def test_theta_falls_when_there_is_room():
    _, theta = _run(atc_lib.init_atc(CFG), np.full(20_000, 0.3))
    theta = np.asarray(theta)
    assert np.all(np.diff(theta) <= 0) and theta[-1] == pytest.approx(CFG.theta_min, abs=1e-3)


def test_no_windup_after_long_saturation():
    state, _ = _run(atc_lib.init_atc(CFG), np.ones(200_000))
    _, theta = _run(state, np.zeros(10_000))
    theta = np.asarray(theta)
    assert theta[0] < CFG.theta_max  # reacts on the first step
    # from θ_max to θ_min at the integrator's rate Ki·ρ*, plus a few steps; a wound-up
    # integrator (I ≈ 2e5) would need ~50× longer
    steps = int(np.argmax(theta <= CFG.theta_min + 1e-3))
    assert 0 < steps <= (CFG.theta_max - CFG.theta_min) / (CFG.ki * CFG.rho_star) + 2


def test_low_hit_rate_never_tightens():
    _, theta = _run(atc_lib.init_atc(CFG), np.ones(5000), hit_rate=0.3)
    assert np.all(np.asarray(theta) <= CFG.theta0)


def test_closed_loop_regulates_pressure_to_target():
    # 400 equal blocks fill the pool with densities uniform in [0, 1]: ρ(θ) = 1 − θ on [0, 1]
    density = jnp.linspace(0.0, 1.0, 400, endpoint=False)
    kib = jnp.full(400, 10, jnp.int32)
    live = jnp.ones(400, bool)

    def step(s, _):
        rho = atc_lib.pressure(
            density_Z=density, kib_Z=kib, live_Z=live, theta=s.theta, capacity_kib=jnp.int32(4000)
        )
        s = atc_lib.update(s.replace(hit_rate=jnp.float32(0.9)), rho=rho, cfg=CFG)
        return s, rho

    state, rho = jax.lax.scan(step, atc_lib.init_atc(CFG), None, length=30_000)
    assert float(rho[-1]) == pytest.approx(CFG.rho_star, abs=0.01)
    assert float(state.theta) == pytest.approx(1 - CFG.rho_star, abs=0.01)


def test_config_validation():
    with pytest.raises(ValueError):
        atc_lib.ATCConfig(rho_star=0.0)
    with pytest.raises(ValueError):
        atc_lib.ATCConfig(theta0=2.0)
