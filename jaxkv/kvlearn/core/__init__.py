"""KVLearn's jitted control plane: pure functions on one state pytree.

pool        the fixed-capacity block table (O(√Z) victim search)
features    per-key history (ghost entries), the PRP's 16 features, delayed label windows
prp         the Prefix Reuse Predictor: online MLP 16 → 32 → 1 with optax, whitening, replay
cars        CARS = P̂·(R − T) − U and the normalised value density ν used for ranking
atc         the Adaptive Threshold Controller (PI on the pressure at θ, anti-windup)
control     KVLearnState and lookup / admit / feed_labels / tick
facade      ``Coordinator``: a stateful Python wrapper for a serving stack
pretrain    offline PRP training on collected labels
checkpoint  PRP save / restore (``jaxkv.checkpoint``)
"""
