"""Policy checkpoints shipped with jaxkv, one folder each (``learned:<folder name>``).

``distillcache_smollm2_cpu/``: the DistillCache policy trained on the embedded SmolLM2-135M
with ``configs/distillcache_cpu.yaml`` (see its ``config.yaml``, ``metrics.jsonl`` and
``training.png``).
"""
