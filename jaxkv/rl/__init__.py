"""Reinforcement learning for learned KV-cache eviction (DistillCache training)."""
