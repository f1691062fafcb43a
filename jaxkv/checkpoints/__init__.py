"""Policy checkpoints shipped with jaxkv, one folder each (``learned:<folder name>`` or
``ranker:<folder name>``).

``distillcache_smollm2_cpu/``: the DistillCache policy trained on the embedded SmolLM2-135M
with ``configs/distillcache_cpu.yaml`` (see its ``config.yaml``, ``metrics.jsonl`` and
``training.png``).

``ranker_smollm2_cpu/``: the supervised per-head ranker (``jaxkv.policies.ranker``) trained on
the embedded model with ``python -m jaxkv.train ranker --windows-per-domain 12 --steps 1500
--target value`` (prose, math, code and chat; BIG-Bench Hard held out). Its ``ranker.json``
records the settings and the validation scores.

``ranker_global_smollm2_cpu/``: the same recipe with the ListNet pooled over 90 rows
(``--pool 90 --rows-per-step 270``), so its scores compare across rows: the ranker for the
``global`` granularity, chosen by a rule fixed in advance on the training domains' validation
windows (README, "DistillCache out of sample").

``ranker_recall_smollm2_cpu/``: the pooled recipe with the ``recall`` training domain added
(``--domains prose,math,code,chat,recall``; ``jaxkv.rl.recall``), shipped by the validation rule
of ``results/retrieval_recall/PROTOCOL.md`` (its held-out run: ``results/retrieval_recall/``).

``ranker_recall_attended_smollm2_cpu/``: the recall ranker's params with a protected tier, in
each (layer, KV head) row the eighth of the budget the latest query attends to most
(``attended_fraction`` 0.125 in its ``ranker.json``; ``jaxkv.policies.ranker.retier``), shipped
by the rule of ``results/retrieval_attended/PROTOCOL.md`` (``scripts/retrieval_attended.sh``).

``ranker_recall_tier_smollm2_cpu/``: the same params with half the budget in that tier
(``attended_fraction`` 0.5), chosen among 0.125, 0.25 and 0.5 by the rule of
``results/retrieval_tier/PROTOCOL.md`` (``scripts/retrieval_tier.sh``).

``ranker_peak_tier_smollm2_cpu/``: the recall recipe trained on the ``peak`` target (the most
attention any one of the next 128 queries pays a token, times its value norm; ``--target peak
--chunk 1``) with the same tier (``attended_fraction`` 0.5), shipped by the rule of
``results/distillcache_peak/PROTOCOL.md`` (``scripts/distillcache_peak.sh``): the recommended
decode-protocol policy.
"""
