"""``kvlearn``: KVLearn through its control-plane API (``core.control``): ``lookup`` on every
request, then ``admit`` on a miss; ``tick`` after every chunk of requests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kvlearn.core import control
from jaxkv.kvlearn.sim.policies.base import (
    PolicySetup,
    PoolPolicy,
    RunInputs,
    SimRequest,
    event,
)


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy with ``setup.kvlearn``'s configuration. Starts from ``RunInputs.prp`` when
    given (an offline pre-trained PRP)."""
    if setup.kvlearn is None:
        raise ValueError("kvlearn policy needs a KVLearnConfig (PolicySetup.kvlearn)")
    cfg = setup.kvlearn

    def init(inp: RunInputs):
        cap = inp.capacity_kib.astype(jnp.float32) * 1024.0
        return control.init(cfg, capacity_bytes=cap, key=inp.key, prp_state=inp.prp)

    def lookup(state, req: SimRequest):
        creq = control.Request(key=req.key, tokens=req.tokens, modality=req.modality, time=req.time)
        state, hit = control.lookup(state, creq, cfg=cfg)
        return state, creq, hit

    def step(state, req: SimRequest):
        state, creq, hit = lookup(state, req)

        def on_miss(s):
            s, res = control.admit(s, creq, cfg=cfg)
            return s, res.admitted, res.n_evicted

        def on_hit(s):
            return s, jnp.asarray(False), jnp.zeros((), jnp.int32)

        state, admitted, n_ev = jax.lax.cond(hit, on_hit, on_miss, state)
        return state, event(hit, admitted, n_ev)

    def step_vmap(state, req: SimRequest):
        state, creq, hit = lookup(state, req)
        state, res = control.admit(state, creq, cfg=cfg, active=~hit)  # masked, not a cond
        return state, event(hit, res.admitted, res.n_evicted)

    def diag(state):
        return {
            "theta": state.atc.theta,
            "labels": state.prp.n_labels,
            "prp_updates": state.prp.n_updates,
            "hit_rate_ema": state.atc.hit_rate,
        }

    tick = lambda state, t: control.tick(state, t, cfg=cfg)
    tick_batch = lambda state_B, t_B: control.tick_batch(state_B, t_B, cfg=cfg)
    return PoolPolicy("kvlearn", init, step, tick, diag, tick_batch, step_vmap)
