"""The Python facade for a serving stack's coordinator path."""

import jax
import jax.numpy as jnp
import pytest

from jaxkv.kvlearn import Coordinator, KVLearnConfig
from jaxkv.kvlearn.core import features as features_lib
from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.cost import MIB


def test_coordinator_keeps_evicts_and_reports():
    # U = 0: in a two-block pool the storage price R̄·|b|/M_S would otherwise exceed what an
    # untrained PRP's P̂ ≈ 0.5 promises, and nothing would be admitted
    cfg = KVLearnConfig(max_blocks=8, max_keys=16, storage_dt_s=0.0)
    coord = Coordinator(cfg, capacity_bytes=150 * MIB, seed=0)  # two 72 MiB image blocks fit
    t = 0.0
    for key in ("img/a", "img/b"):
        t += 0.05
        assert not coord.lookup(key, tokens=576, modality="image", now=t)
        d = coord.admit(key, tokens=576, modality="image", now=t)
        assert d.admitted and d.evicted == () and d.n_evicted == 0
    assert sorted(coord.resident()) == ["img/a", "img/b"]
    t += 0.05
    assert coord.lookup("img/a", tokens=576, modality="image", now=t)
    coord.tick(now=t)
    # a third block needs one victim; whatever is decided, the report is consistent
    t += 0.05
    assert not coord.lookup("img/c", tokens=576, modality="image", now=t)
    d = coord.admit("img/c", tokens=576, modality="image", now=t)
    resident = set(coord.resident())
    if d.admitted:
        assert d.n_evicted == 1 and len(d.evicted) == 1 and d.evicted[0] not in resident
        assert resident == {"img/a", "img/b", "img/c"} - set(d.evicted)
    else:
        assert d.evicted == () and resident == {"img/a", "img/b"}
    s = coord.stats()
    assert s["requests"] == 4 and s["hits"] == 1 and s["used_bytes"] <= s["capacity_bytes"]
    assert s["admits"] == 2 + d.admitted and s["evictions"] == d.n_evicted


def test_coordinator_input_errors():
    coord = Coordinator(KVLearnConfig(max_blocks=2, max_keys=2), capacity_bytes=MIB)
    with pytest.raises(ValueError, match="tokens"):
        coord.lookup("a", tokens=0)
    with pytest.raises(ValueError, match="modality"):
        coord.lookup("a", tokens=4, modality="audio")
    coord.lookup("a", tokens=4, now=0.1)
    coord.lookup("b", tokens=4, now=0.2)
    with pytest.raises(RuntimeError, match="max_keys"):
        coord.lookup("c", tokens=4, now=0.3)
    with pytest.raises(ValueError, match="capacity"):
        Coordinator(KVLearnConfig(), capacity_bytes=-1)


def test_admit_without_now_uses_the_lookup_time():
    coord = Coordinator(KVLearnConfig(max_blocks=8, max_keys=16), capacity_bytes=1 << 30)
    assert not coord.lookup("img/a", tokens=576, modality="image")  # wall-clock time
    d = coord.admit("img/a", tokens=576, modality="image")
    # same time → same features as observed by the lookup → whitened to exactly zero; and no
    # exposure yet for the count posterior (the stream's first request, at that same time)
    mlp = jax.nn.sigmoid(prp_lib.logits(coord.state.prp.params, jnp.zeros(16), hidden=32))
    st = coord.state
    expected = features_lib.rate_posterior(
        st.hist,
        0,
        mlp,
        t=st.first_t,
        t0=st.first_t,
        horizon_s=coord.cfg.horizon_s,
        prior_s=coord.cfg.count_prior_s,
        expected_reuses=coord.cfg.expected_reuses,
    )
    assert d.p_hat == pytest.approx(float(expected), abs=1e-7)
