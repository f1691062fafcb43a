"""KVLearn: learned keep/discard decisions for the KV pool of a disaggregated serving system.

Three products share this package (data flows top to bottom in each):

    cost, traces, workloads   the cost model, trace types and loaders, synthetic workloads
    core/      the jitted control plane: pool, features, prp, cars, atc, control, facade,
               pretrain, checkpoint (``Coordinator`` for a serving stack)
    sim/       the ``lax.scan`` simulator of whole-prefix requests (the Zipf workload or a trace
               file): ``simulate`` and its pool policies (``PoolPolicy``, ``sim/policies/``)
    serving/   the plain-Python discrete-event simulator of Mooncake traces at block
               granularity: ``engine``, ``prefix``, ``metrics``, ``rate``, ``oracle`` and its
               block policies (``BlockPolicy``, ``serving/policies/``)
    calibrate, report          the cost model from jaxkv's decoder; result tables and plots

The command lines live in ``jaxkv/cli/kvlearn.py`` (``python -m jaxkv.eval kvlearn
sim|serve|calibrate|workload``, ``python -m jaxkv.train kvlearn``). Shape suffixes follow the
KVLearn glossary in ``jaxkv/config.py``. This module is the public face: it imports from the
modules below and none of them imports it.
"""

from jaxkv.kvlearn.core.atc import ATCConfig
from jaxkv.kvlearn.core.checkpoint import load_prp, save_prp
from jaxkv.kvlearn.core.control import (
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
from jaxkv.kvlearn.core.facade import Coordinator, Decision
from jaxkv.kvlearn.core.prp import PRPConfig, PRPState, init_prp
from jaxkv.kvlearn.cost import CostModel, KVShape
from jaxkv.kvlearn.serving.engine import ServingConfig
from jaxkv.kvlearn.serving.policies import BLOCK_POLICIES
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.sim.policies import POOL_POLICIES
from jaxkv.kvlearn.sim.policies.base import PoolPolicy
from jaxkv.kvlearn.sim.simulate import SimConfig, compare, run, run_batch, sweep
from jaxkv.kvlearn.traces import (
    MooncakeTrace,
    Trace,
    TraceError,
    load_jsonl,
    load_mooncake,
    load_mooncake_trace,
    save_jsonl,
    save_mooncake_jsonl,
)
from jaxkv.kvlearn.workloads import MMSessionConfig, mm_session, zipf_multimodal

__all__ = [
    "ATCConfig",
    "AdmitResult",
    "BLOCK_POLICIES",
    "BlockPolicy",
    "Coordinator",
    "CostModel",
    "Decision",
    "KVLearnConfig",
    "KVLearnState",
    "KVShape",
    "MMSessionConfig",
    "MooncakeTrace",
    "POOL_POLICIES",
    "PRPConfig",
    "PRPState",
    "PoolPolicy",
    "Request",
    "ServingConfig",
    "SimConfig",
    "Trace",
    "TraceError",
    "admit",
    "compare",
    "feed_labels",
    "init",
    "init_prp",
    "load_jsonl",
    "load_mooncake",
    "load_mooncake_trace",
    "load_prp",
    "lookup",
    "mm_session",
    "run",
    "run_batch",
    "save_jsonl",
    "save_mooncake_jsonl",
    "save_prp",
    "sweep",
    "tick",
    "zipf_multimodal",
]
