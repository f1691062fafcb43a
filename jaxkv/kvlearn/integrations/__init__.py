"""jaxkv inside other serving engines. Nothing here is imported by ``jaxkv`` itself.

    vllm_policy   jaxkv's block policies (``lru``, ``arc``, ``cost_aware``, ``gdsf``,
                  ``kvlearn`` and its guard) as vLLM KV-offload ``CachePolicy`` classes,
                  loadable by vLLM through ``cache_policy_module_path``.
    vllm_replay   a Mooncake trace replayed through vLLM's own ``CPUOffloadingManager``; the
                  call-by-call cross-check of jaxkv's ``lru``/``arc`` against vLLM's.

Both modules import vLLM when they are imported (its ``CachePolicy`` is a base class here); this
package's ``__init__`` imports neither, so ``import jaxkv.kvlearn.integrations`` works without
vLLM. Build the environment they need with ``scripts/vllm_env.sh`` (``.venv-vllm``).
"""

VLLM_POLICY_MODULE = "jaxkv.kvlearn.integrations.vllm_policy"
"""What vLLM's ``cache_policy_module_path`` names to load a policy of ``vllm_policy``."""
JAXKV_POLICIES = (
    "JaxkvLRU",
    "JaxkvARC",
    "JaxkvCostAware",
    "JaxkvGDSF",
    "KVLearnCachePolicy",
    "KVLearnGuardCachePolicy",
    "KVLearnGuardFloorCachePolicy",
)
"""jaxkv's vLLM cache policies, by class name in ``VLLM_POLICY_MODULE``."""
