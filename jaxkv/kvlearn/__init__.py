"""KVLearn: learned keep/discard decisions for the KV pool of a disaggregated serving system.

Modules (data flows top to bottom):

    cost       footprint |b|, recompute R (continuous envelope), transfer T, storage U, CARS terms
    traces     the README's Zipf multimodal workload, JSONL and Mooncake trace loaders
    pool       the fixed-capacity block table (pure functions, O(√C) victim search)
    features   per-key history (ghost entries), the PRP's 16 features, delayed label windows
    prp        the Prefix Reuse Predictor: online MLP 16 → 32 → 1 with optax, whitening, replay
    cars       CARS = P̂·(R − T) − U and the normalised value density ν used for ranking
    atc        the Adaptive Threshold Controller (PI on the pressure at θ, anti-windup)
    control    the control plane: KVLearnState and lookup / admit / feed_labels / tick
    facade     ``Coordinator``: a stateful Python wrapper for a serving stack
    baselines  simulator policies: no_cache, lru, random_lru, lfu, oracle_static, belady, kvlearn
    simulate   lax.scan simulator, vmap over runs, metrics, sweeps
    pretrain / checkpoint   offline PRP training and orbax save / restore
    cli        ``python -m jaxkv.eval kvlearn`` and ``python -m jaxkv.train kvlearn``

Serving scale (plain Python/numpy, Mooncake traces):

    prefix         block-granular prefix cache (longest resident leading run, leaf eviction)
    serving        Mooncake loader, FCFS prefill nodes, TTFT/throughput records, block policies
    block_kvlearn  KVLearn's design at block granularity (online logistic PRP, gated admission)
    mmsession      MM-Session workload generator (Mooncake JSONL)
    calibrate      α_bw, α_flop from jaxkv's own decoder (``kvlearn calibrate``)
    serving_cli    the CLI mode for Mooncake files
"""

from jaxkv.kvlearn.atc import ATCConfig
from jaxkv.kvlearn.baselines import POLICIES
from jaxkv.kvlearn.checkpoint import load_prp, save_prp
from jaxkv.kvlearn.control import (
    AdmitResult,
    KVLearnConfig,
    KVLearnState,
    Request,
    admit,
    feed_labels,
    init,
    lookup,
    tick,
)
from jaxkv.kvlearn.cost import CostModel, KVShape
from jaxkv.kvlearn.facade import Coordinator, Decision
from jaxkv.kvlearn.prp import PRPConfig
from jaxkv.kvlearn.simulate import SimConfig, compare, run, run_batch, sweep
from jaxkv.kvlearn.traces import (
    Trace,
    TraceError,
    load_jsonl,
    load_mooncake,
    save_jsonl,
    zipf_multimodal,
)

__all__ = [
    "ATCConfig",
    "AdmitResult",
    "Coordinator",
    "CostModel",
    "Decision",
    "KVLearnConfig",
    "KVLearnState",
    "KVShape",
    "POLICIES",
    "PRPConfig",
    "Request",
    "SimConfig",
    "Trace",
    "TraceError",
    "admit",
    "compare",
    "feed_labels",
    "init",
    "load_jsonl",
    "load_mooncake",
    "lookup",
    "run",
    "run_batch",
    "save_jsonl",
    "save_prp",
    "load_prp",
    "sweep",
    "tick",
    "zipf_multimodal",
]
