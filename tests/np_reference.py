"""A plain-numpy reference decoder that materializes every softmax matrix.

It runs passes over an explicit set of visible key positions per (layer, KV head), keeps
its own keys and values by position, and accumulates the attention statistics from their
written definitions with Python loops. Independent of jaxkv's attention code.
"""

import math

import numpy as np


def rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, pos, theta):
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
    ang = pos * inv
    x1, x2 = x[: H // 2], x[H // 2 :]
    return np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)]
    )


class RefModel:
    def __init__(self, params, config, window=64):
        self.p = {
            k: (
                np.asarray(v, np.float64)
                if not isinstance(v, dict)
                else {n: np.asarray(a, np.float64) for n, a in v.items()}
            )
            for k, v in params.items()
        }
        self.c = config
        self.lam = math.exp(-1.0 / window)
        self.kv = {}  # (layer, kv_head, pos) -> (k, v)
        self.stats = {}  # (layer, kv_head, pos) -> dict

    def run_pass(self, tokens, positions, visible):
        """Feeds tokens at positions; ``visible[(l, k)]`` = cached positions each head sees
        (new tokens always see each other causally). Returns logits per token."""
        c, P = self.c, self.p
        L, K, G, H = c.n_layers, c.n_kv_heads, c.q_per_kv, c.head_dim
        x = P["embed"][tokens]
        final = max(positions)
        for l in range(L):
            lp = {n: a[l] for n, a in P["layers"].items()}
            h = rms(x, lp["attn_norm"], c.norm_eps)
            q = np.einsum("td,dnh->tnh", h, lp["wq"])
            k = np.einsum("td,dkh->tkh", h, lp["wk"])
            v = np.einsum("td,dkh->tkh", h, lp["wv"])
            for t, pos in enumerate(positions):
                for kh in range(K):
                    self.kv[(l, kh, pos)] = (rope(k[t, kh], pos, c.rope_theta), v[t, kh])
            out = np.zeros((len(tokens), K * G, H))
            contrib = {}  # (kh, pos) -> sums over g of each statistic's pass contribution
            for kh in range(K):
                for g in range(G):
                    n = kh * G + g
                    for t, qpos in enumerate(positions):
                        keys = [kp for kp in visible[(l, kh)] if kp <= qpos] + [
                            kp for kp in positions if kp <= qpos
                        ]
                        if c.sliding_window is not None:
                            keys = [kp for kp in keys if kp > qpos - c.sliding_window]
                        qv = rope(q[t, n], qpos, c.rope_theta)
                        s = np.array([qv @ self.kv[(l, kh, kp)][0] for kp in keys]) / math.sqrt(H)
                        a = np.exp(s - s.max())
                        a /= a.sum()
                        out[t, n] = sum(
                            ai * self.kv[(l, kh, kp)][1] for ai, kp in zip(a, keys, strict=True)
                        )
                        ent = -np.sum(a * np.log(a))
                        w_recent = self.lam ** (final - qpos)
                        for ai, kp in zip(a, keys, strict=True):
                            d = contrib.setdefault((kh, kp), np.zeros(5))
                            if qpos == final:
                                d[0] += ai / G
                                d[1] += ai**2 / G
                            d[2] += ai / G
                            d[3] += w_recent * ai / G
                            d[4] += w_recent * ai * ent / G
            self._update_stats(l, contrib, visible, positions, v)
            x = x + np.einsum("tnh,nhd->td", out, lp["wo"])
            h = rms(x, lp["mlp_norm"], c.norm_eps)
            gate = h @ lp["w_gate"]
            x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["w_up"])) @ lp["w_down"]
        h = rms(x, P["final_norm"], c.norm_eps)
        head = P["embed"].T if c.tie_embeddings else P["lm_head"]
        return h @ head

    def _update_stats(self, l, contrib, visible, positions, v):
        decay = self.lam ** len(positions)
        for kh in range(self.c.n_kv_heads):
            for kp in visible[(l, kh)]:
                st = self.stats[(l, kh, kp)]
                d = contrib.get((kh, kp), np.zeros(5))
                st["attn"], st["attn_sq"] = d[0], d[1]
                st["attn_cum"] += d[2]
                st["recent"] = decay * st["recent"] + d[3]
                st["recent_ent"] = decay * st["recent_ent"] + d[4]
            for t, kp in enumerate(positions):
                d = contrib.get((kh, kp), np.zeros(5))
                self.stats[(l, kh, kp)] = dict(
                    attn=d[0],
                    attn_sq=d[1],
                    attn_cum=d[2],
                    recent=d[3],
                    recent_ent=d[4],
                    vnorm=np.linalg.norm(v[t, kh]),
                )
