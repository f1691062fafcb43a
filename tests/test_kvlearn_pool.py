"""KVLearn block table: capacity, eviction order, value rule, and a 10^5-operation property test
against an independent pure-Python pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kvlearn.core import pool as pool_lib

# ---- plain-Python reference ----------------------------------------------------------------


class RefPool:
    """Dict-and-list reference with the documented semantics (free-slot stack, (rank, slot)
    victim order, at most ``max_victims`` victims, rules all/value/rank)."""

    def __init__(self, max_blocks, capacity_kib, max_victims):
        self.cap = capacity_kib
        self.max_victims = min(max_victims, max_blocks)
        self.free = list(range(max_blocks - 1, -1, -1))  # top = end
        self.slots = {}  # slot -> [key, kib, rank, value]
        self.where = {}  # key -> slot

    @property
    def used(self):
        return sum(e[1] for e in self.slots.values())

    def lookup(self, key):
        return self.where.get(key, -1)

    def set_entry(self, key, rank, value):
        if key in self.where:
            e = self.slots[self.where[key]]
            e[2], e[3] = rank, value

    def _evict(self, victims):
        for s in victims:
            key = self.slots.pop(s)[0]
            del self.where[key]
            self.free.append(s)

    def remove(self, key):
        if key in self.where:
            self._evict([self.where[key]])

    def admit(self, key, kib, rank, value, allowed, rule):
        if not allowed or kib > self.cap or key in self.where:
            return False, []
        need = self.used + kib - self.cap
        need_slot = not self.free
        order = sorted(self.slots, key=lambda s: (self.slots[s][2], s))
        victims, freed = [], 0
        for s in order:
            if (
                not (freed < need or (need_slot and not victims))
                or len(victims) >= self.max_victims
            ):
                break
            victims.append(s)
            freed += self.slots[s][1]
        if freed < need or (need_slot and not victims):
            return False, []
        if rule == "value" and victims and not value > sum(self.slots[s][3] for s in victims):
            return False, []
        if rule == "rank" and victims and not rank > max(self.slots[s][2] for s in victims):
            return False, []
        self._evict(victims)
        slot = self.free.pop()
        self.slots[slot] = [key, kib, rank, value]
        self.where[key] = slot
        return True, victims

    def snapshot(self):
        return {s: tuple(e) for s, e in self.slots.items()}


def jax_snapshot(pool):
    key = np.asarray(pool.key_Z)
    kib, rank, value = (np.asarray(a) for a in (pool.kib_Z, pool.rank_Z, pool.value_Z))
    return {
        int(s): (int(key[s]), int(kib[s]), float(rank[s]), float(value[s]))
        for s in np.flatnonzero(key >= 0)
    }


# ---- directed tests ---------------------------------------------------------------------------


def _fill(pool, blocks):
    for key, kib, rank, value in blocks:
        pool, ok, _ = pool_lib.admit(pool, key=key, kib=kib, rank=rank, value=value)
        assert bool(ok)
    return pool


def test_eviction_takes_lowest_value_per_byte_first():
    pool = pool_lib.init_pool(max_blocks=8, max_keys=16, capacity_kib=1000)
    # rank = value per byte; sizes differ so rank order != value order
    pool = _fill(
        pool, [(0, 300, 0.5, 150.0), (1, 200, 0.1, 20.0), (2, 300, 0.3, 90.0), (3, 200, 0.9, 180.0)]
    )
    pool, ok, victims = pool_lib.admit(pool, key=4, kib=400, rank=0.8, value=1000.0, rule="value")
    assert bool(ok)
    # keys 1 (ν 0.1) then 2 (ν 0.3) are evicted, in that order; 0 (ν 0.5) has a higher value
    # (150) than 2 (90) but a lower one per byte than 3, and stays: ranking is per byte
    assert [int(k) for k in victims.key_E if k >= 0] == [1, 2]
    resident = sorted(int(k) for k in np.asarray(pool.key_Z) if k >= 0)
    assert resident == [0, 3, 4]
    assert int(pool.used_kib) == 900


def test_value_rule_never_destroys_more_value_than_it_adds():
    pool = pool_lib.init_pool(max_blocks=8, max_keys=16, capacity_kib=600)
    pool = _fill(pool, [(0, 300, 0.2, 60.0), (1, 300, 0.3, 90.0)])
    before = jax_snapshot(pool)
    # needs both victims (150 ms of value) but brings 149 ms: refused, nothing changes
    pool, ok, victims = pool_lib.admit(pool, key=2, kib=500, rank=0.9, value=149.0, rule="value")
    assert not bool(ok) and jax_snapshot(pool) == before
    assert not np.any(np.asarray(victims.valid_E))
    pool, ok, victims = pool_lib.admit(pool, key=2, kib=500, rank=0.9, value=151.0, rule="value")
    assert bool(ok)
    assert sorted(int(k) for k in np.asarray(pool.key_Z) if k >= 0) == [2]


def test_capacity_and_oversized_blocks():
    pool = pool_lib.init_pool(max_blocks=4, max_keys=8, capacity_kib=100)
    pool, ok, _ = pool_lib.admit(pool, key=0, kib=101, rank=1.0, value=1.0)
    assert not bool(ok) and int(pool.used_kib) == 0
    for k in range(6):  # slot limit (4) binds before bytes (4 × 10 < 100)
        pool, ok, _ = pool_lib.admit(pool, key=k, kib=10, rank=float(k), value=1.0)
        assert bool(ok)
    assert int(jnp.sum(pool_lib.resident(pool))) == 4 and int(pool.used_kib) == 40
    assert sorted(int(k) for k in np.asarray(pool.key_Z) if k >= 0) == [2, 3, 4, 5]


def test_init_rejects_bad_sizes():
    with pytest.raises(ValueError, match="capacity"):
        pool_lib.init_pool(max_blocks=4, max_keys=4, capacity_kib=-1)
    with pytest.raises(ValueError, match="positive"):
        pool_lib.init_pool(max_blocks=0, max_keys=4, capacity_kib=10)
    with pytest.raises(ValueError, match="rule"):
        pool_lib.admit(
            pool_lib.init_pool(max_blocks=2, max_keys=2, capacity_kib=1),
            key=0,
            kib=1,
            rank=0.0,
            value=0.0,
            rule="lru",
        )


# ---- property test --------------------------------------------------------------------------

N_OPS, CHUNK = 100_000, 10_000
MAX_BLOCKS, MAX_KEYS, CAPACITY, MAX_VICTIMS = 40, 120, 3000, 6
LOOKUP, ADMIT_VALUE, ADMIT_ALL, ADMIT_RANK, SET, REMOVE = range(6)


def _ops(seed):
    rng = np.random.default_rng(seed)
    op = rng.choice(6, size=N_OPS, p=[0.2, 0.3, 0.15, 0.1, 0.15, 0.1]).astype(np.int32)
    key = rng.integers(0, MAX_KEYS, N_OPS).astype(np.int32)
    small = rng.integers(1, 25, N_OPS)
    large = rng.integers(150, 900, N_OPS)
    kib = np.where(rng.random(N_OPS) < 0.5, small, large).astype(np.int32)
    kib[rng.random(N_OPS) < 0.01] = CAPACITY + 1  # never fits
    rank = rng.random(N_OPS).astype(np.float32)  # distinct with probability ~1
    value = rng.integers(0, 60, N_OPS).astype(np.float32)  # integers: sums are exact in f32
    allowed = rng.random(N_OPS) < 0.9
    return op, key, kib, rank, value, allowed


def _step(pool, x):
    op, key, kib, rank, value, allowed = x
    slot = pool_lib.lookup(pool, key)

    def admit(rule):
        def f(p):
            p, ok, v = pool_lib.admit(
                p, key=key, kib=kib, rank=rank, value=value, allowed=allowed, rule=rule
            )
            return p, ok, jnp.sum(v.valid_E, dtype=jnp.int32)

        return f

    def other(fn):
        return lambda p: (fn(p), jnp.asarray(False), jnp.zeros((), jnp.int32))

    branches = [
        other(lambda p: p),
        admit("value"),
        admit("all"),
        admit("rank"),
        other(
            lambda p: pool_lib.set_entry(p, slot=pool_lib.lookup(p, key), rank=rank, value=value)
        ),
        other(lambda p: pool_lib.remove(p, key)),
    ]
    pool, ok, n_ev = jax.lax.switch(op, branches, pool)
    return pool, (slot, ok, n_ev)


@jax.jit
def _run_chunk(pool, xs):
    return jax.lax.scan(_step, pool, xs)


def test_property_1e5_random_operations_match_reference():
    ops = _ops(seed=1234)
    ref = RefPool(MAX_BLOCKS, CAPACITY, MAX_VICTIMS)
    pool = pool_lib.init_pool(
        max_blocks=MAX_BLOCKS, max_keys=MAX_KEYS, capacity_kib=CAPACITY, max_victims=MAX_VICTIMS
    )
    rule = {ADMIT_VALUE: "value", ADMIT_ALL: "all", ADMIT_RANK: "rank"}
    n_admitted = n_refused = n_evicted = 0
    for start in range(0, N_OPS, CHUNK):
        xs = tuple(jnp.asarray(a[start : start + CHUNK]) for a in ops)
        pool, (slot, ok, n_ev) = _run_chunk(pool, xs)
        slot, ok, n_ev = np.asarray(slot), np.asarray(ok), np.asarray(n_ev)
        for j in range(CHUNK):
            op, key, kib, rank, value, allowed = (a[start + j] for a in ops)
            key, kib, rank, value = int(key), int(kib), float(rank), float(value)
            assert slot[j] == ref.lookup(key), f"op {start + j}"
            if op in rule:
                r_ok, victims = ref.admit(key, kib, rank, value, bool(allowed), rule[op])
                assert (ok[j], n_ev[j]) == (r_ok, len(victims)), f"op {start + j}"
                n_admitted += r_ok
                n_refused += not r_ok
                n_evicted += len(victims)
            elif op == SET:
                ref.set_entry(key, rank, value)
            elif op == REMOVE:
                ref.remove(key)
            assert ref.used <= CAPACITY
        # checkpoint: full state, capacity and internal consistency
        assert jax_snapshot(pool) == ref.snapshot()
        assert int(pool.used_kib) == ref.used <= CAPACITY
        keys = np.asarray(pool.key_Z)
        slot_k = np.asarray(pool.slot_P)
        assert all(slot_k[keys[s]] == s for s in np.flatnonzero(keys >= 0))
        assert np.sum(slot_k >= 0) == np.sum(keys >= 0) == MAX_BLOCKS - int(pool.n_free)
        live_rank = np.where(keys >= 0, np.asarray(pool.rank_Z), np.inf)
        np.testing.assert_array_equal(
            np.asarray(pool.group_min_Y), live_rank.reshape(pool.group_min_Y.shape[0], -1).min(1)
        )
    # the sequence exercised every path
    assert n_admitted > 10_000 and n_refused > 5_000 and n_evicted > 5_000
