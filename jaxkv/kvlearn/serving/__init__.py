"""The serving simulator: a plain-Python discrete-event replay of Mooncake traces at block
granularity (prefix cache, FCFS prefill nodes, decode slots).

    engine         ServingConfig and ``simulate`` (one run's per-request records)
    prefix         the block-granular prefix cache
    policies/      the block policies (``BlockPolicy``), one module each, and their registry
    predictors     the reuse predictors of the block-level KVLearn
    oracle         future knowledge of a trace (next use, the best static prefix-closed set)
    metrics        ``summarize`` and ``compare`` (one row per policy)
    rate           the maximum sustainable arrival rate at the TTFT SLO
"""
