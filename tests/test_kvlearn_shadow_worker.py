"""The guard's shadows in a forked worker (``serving.shadow_worker``) decide exactly what they
decide in one process; the worker's answers, failures and exit; and the PRP's delayed
predictions (``HostPRP.observe`` / ``resolve``), which the ``gd`` shadow relies on."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine, shadow_worker
from jaxkv.kvlearn.serving import policies as policies_lib
from jaxkv.kvlearn.serving.policies.kvlearn_experts import ExpertKVLearn
from jaxkv.kvlearn.serving.predictors import DeferredPRP, HostPRP
from jaxkv.kvlearn.serving.prefix import PrefixCache

COST = CostModel.llama3_8b_a100()
needs_fork = pytest.mark.skipif(not shadow_worker.available(), reason="needs fork and 2 CPUs")


def _agent_trace(tmp_path, n: int, seed: int) -> traces_lib.MooncakeTrace:
    traces_lib.save_mooncake_jsonl(workloads.agent(n, seed=seed), tmp_path / "agent.jsonl")
    return traces_lib.load_mooncake_trace(tmp_path / "agent.jsonl")


@needs_fork
@pytest.mark.parametrize(
    "setting",
    [
        # the confirmed setting's shape: follow the best shadow, block KVLearn among them
        dict(
            experts=("lru",),
            learner=False,
            baselines=("mooncake", "cost_aware", "cost_aware@2", "gdsf", "lfu", "s3fifo", "gd"),
            size_power=0.25,
        ),
        # a learner (the real pool's PRP) guarded by independent-key and prefix shadows
        dict(experts=("gd",), baselines=("mooncake", "lru", "arc", "wtinylfu"), slack=0.0),
    ],
)
def test_parallel_guard_is_the_serial_guard(monkeypatch, tmp_path, setting):
    """Every record of a run is bit-identical with the worker and without it, the follow
    rule's evictions and the baselines' changes of leader included."""
    made: list[ExpertKVLearn] = []

    class Kept(ExpertKVLearn):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setitem(policies_lib.REGISTRY, "kvlearn_experts", Kept)
    tr = _agent_trace(tmp_path, 300, seed=5)
    pool = int(0.1 * len(np.unique(np.concatenate(tr.blocks))))
    cfg = engine.ServingConfig(pool_blocks=pool, prefill_nodes=4)
    runs = [
        engine.simulate(
            tr, "kvlearn_experts", cfg=cfg, cost=COST, choice="guard", parallel=p, **setting
        )
        for p in (True, False)
    ]
    (par, ser), (pol_par, pol_ser) = runs, made
    assert pol_par.worker is not None and pol_ser.worker is None
    assert len(pol_par._remote) == len(pol_ser._local) - len(pol_par._local) > 0
    for key in ser:
        np.testing.assert_array_equal(np.asarray(par[key]), np.asarray(ser[key]), err_msg=key)
    assert pol_ser.xs.follow_evictions > 0 and pol_ser.xs.base_switches > 0
    for a, b in ((pol_par.xs, pol_ser.xs),):
        assert (a.follow_evictions, a.base_switches, a.backoff_requests) == (
            b.follow_evictions,
            b.base_switches,
            b.backoff_requests,
        )
        np.testing.assert_array_equal(a.saved_base_B, b.saved_base_B)
    with pytest.raises(ChildProcessError):  # the run's end reaped the worker
        os.waitpid(pol_par.worker.pid, os.WNOHANG)


class _Scripted:
    """A stand-in shadow: ``store`` makes the request's blocks resident and evicts block 0
    (through its hook), or raises."""

    def __init__(self, fail: bool = False):
        self.cache = PrefixCache(4, n_blocks=8)
        self.on_evict = None
        self.fail = fail

    def lookup(self, blocks, i, now):
        return 0

    def store(self, blocks, i):
        if self.fail:
            raise ValueError("scripted failure")
        for b in blocks:
            self.cache.res_view[b] = True
        self.cache.res_view[0] = False
        self.on_evict(0)


@needs_fork
def test_worker_answers_with_evictions_and_shared_residency():
    a, b = _Scripted(), _Scripted()
    w = shadow_worker.ShadowWorker([a, b], [[0, 1], [2, 3]])
    w.lookup(0, 0.0)
    w.store(1)
    assert [list(e) for e in w.evictions()] == [[0], [0]]
    assert a.cache.resident.tolist() == b.cache.resident.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    w.close()
    w.close()  # idempotent
    with pytest.raises(ChildProcessError):
        os.waitpid(w.pid, os.WNOHANG)


@needs_fork
def test_worker_failure_is_raised_with_its_traceback():
    w = shadow_worker.ShadowWorker([_Scripted(fail=True)], [[0, 1]])
    w.store(0)
    with pytest.raises(RuntimeError, match="scripted failure"):
        w.evictions()
    with pytest.raises(RuntimeError, match="exited"):  # the child has stopped serving
        w.store(0)
        w.evictions()
    w.close()


@pytest.mark.parametrize("cls", [HostPRP, DeferredPRP])
def test_prp_resolves_later_what_it_would_predict_now(cls):
    """Rows observed before several training rounds and resolved after them get the P̂ that
    ``predict`` gave at the time (the parameters and whitening statistics of that moment), bit
    for bit; the host's parameters are the state's."""
    rng = np.random.default_rng(0)
    now, later = cls(seed=3), cls(seed=3)
    want, observed = [], []
    for step in range(40):
        x = rng.normal(size=(int(rng.integers(1, 30)), 16)).astype(np.float32)
        want.append(now.predict(x))
        observed.append(later.observe(x))
        y = (rng.random(len(x) * 2) < 0.3).astype(np.float32)
        xy = np.concatenate([x, x])
        now.learn(xy, y)
        later.learn(xy, y)
        if step % 7 == 6:  # resolve a backlog spanning rounds, in order
            got = [later.resolve(o) for o in observed]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
            want, observed = [], []
    assert later.rounds > 5
    for p, q in zip(
        jax.tree.leaves(later.params),
        jax.tree.leaves(jax.device_get(later.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(p, q)
