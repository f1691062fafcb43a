"""jaxkv's vLLM KV-offload policies against vLLM's own (run in .venv-vllm: scripts/vllm_env.sh).

    .venv-vllm/bin/python scripts/bench_vllm_policy.py [--cross-check] [--replay] [--overhead]
        [--quick] [--out results/kvlearn]

--cross-check  every evict call of vLLM's lru/arc against jaxkv's (JaxkvLRU/JaxkvARC) on the
               shipped trace and on generated workloads (chat, agent, rag, mm_session), plus the
               diagnosis: jaxkv's ARC with the three changes that vLLM 0.32's ARC has
               (``Arc032``, defined here only) -> vllm_crosscheck.md
--replay       hit rate, transfer, TTFT of all five policies through vLLM's manager on the
               shipped trace -> vllm_replay.md
--overhead     per-call latency at 100k resident blocks, side by side -> vllm_overhead.md
--e2e          vLLM's own engine on CPU with the OffloadingConnector and KVLearnCachePolicy,
               on a tiny random-weight Llama (no SmolLM2 in HF format is on the machine; the
               failure happens before any weight matters) -> vllm_e2e.md
(no flag: the first three). --quick: fewer pools and workloads (a smoke run; nothing written).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus, order_request_keys

import jaxkv.data as data_lib
from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.integrations import vllm_policy, vllm_replay
from jaxkv.kvlearn.serving.engine import ServingConfig
from jaxkv.kvlearn.serving.policies.arc import ARC
from jaxkv.kvlearn.traces import MooncakeTrace, load_mooncake_trace, save_mooncake_jsonl

COST = CostModel.llama3_8b_a100()


# ---- the diagnosis: jaxkv's ARC changed to vLLM 0.32's semantics (this script only) -----------
class _ARC032(ARC):
    """jaxkv's ``ARC`` with vLLM 0.32's adaptation: δ = max(1, |B2|/|B1|) as a float (p a
    float, the test |T1| ≥ int(p)), and a ghost hit moves the id to its ghost list's MRU end."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.p = 0.0

    def on_access(self, blocks, hit, i, now):
        super().on_access(np.zeros(0, np.int64), 0, i, now)  # closes the store batch only
        for b in reversed(blocks.tolist()):
            if b in self.t1:
                del self.t1[b]
                self.t2[b] = None
            elif b in self.t2:
                self.t2.move_to_end(b)
            elif b in self.b1:
                self.p = min(self.p + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(b)
            elif b in self.b2:
                self.p = max(self.p - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(b)

    def victim(self, incoming):
        n_old = len(self.t1) - len(self.batch)
        if n_old > 0 and n_old >= int(self.p):
            return next(iter(self.t1))
        return next(iter(self.t2), None)


class Arc032(vllm_policy.JaxkvARC):
    """``JaxkvARC`` over ``_ARC032``, and vLLM 0.32's request finish: the blocks a request only
    stored move to their list's MRU end in reverse prefix order (the head ends most recent)."""

    def _make_arc(self):
        shape = vllm_policy.shape_trace(n_blocks=0, max_depth=1, block_tokens=self.block_tokens)
        return _ARC032(shape, COST, pool_blocks=self.cache_capacity)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        self.arc.on_access(np.zeros(0, np.int64), 0, self.n_req, 0.0)
        for key in reversed(order_request_keys(key_groups, req_context)):
            b = self.ids.get(key)
            if key in insertion_only_keys:
                for lst in (self.arc.t1, self.arc.t2):
                    if b in lst:
                        lst.move_to_end(b)
                        break
            elif key in reused_keys and key in self.chunks:
                self._access([key])
        self.n_req += 1


vllm_policy.Arc032 = Arc032  # vLLM's factory loads it by name from the module path
vllm_replay.JAXKV_POLICIES = (*vllm_replay.JAXKV_POLICIES, "Arc032")


# ---- traces ---------------------------------------------------------------------------------
def shipped() -> MooncakeTrace:
    return load_mooncake_trace(data_lib.data_file(data_lib.MOONCAKE_EXAMPLE))


def generated(quick: bool) -> dict[str, MooncakeTrace]:
    n = 600 if quick else 2000
    made = {
        "chat": workloads.chat(n, seed=0),
        "agent": workloads.agent(n, seed=0),
        "rag": workloads.rag(n, seed=0),
        "mm_session": workloads.mm_session(n // 4, seed=0),
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, records in made.items():
            path = Path(tmp) / f"{name}.jsonl"
            save_mooncake_jsonl(records, path)
            out[name] = load_mooncake_trace(path)
    return out


# ---- cross-check ----------------------------------------------------------------------------
def cross_check(quick: bool) -> str:
    pairs = (("lru", "JaxkvLRU"), ("arc", "JaxkvARC"), ("arc", "Arc032"))
    cases = [("shipped", shipped(), 24, (0.05, 0.25) if quick else (0.02, 0.05, 0.1, 0.25, 0.5))]
    fracs = (0.1,) if quick else (0.05, 0.1, 0.25)
    cases += [(name, tr, 8, fracs) for name, tr in generated(quick).items()]
    lines = [
        "| trace | requests | pool | vLLM | jaxkv | evict calls | matching calls | first "
        "mismatch | chunks evicted | refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = {p: [0, 0] for p in pairs}
    for name, tr, nodes, fr in cases:
        for f in fr:
            cfg = ServingConfig(pool_blocks=max(1, int(f * tr.n_blocks)), prefill_nodes=nodes)
            for row in vllm_replay.cross_check(tr, cfg=cfg, cost=COST, pairs=pairs):
                total[(row["vllm"], row["jaxkv"])][0] += row["calls"]
                total[(row["vllm"], row["jaxkv"])][1] += row["matches"]
                lines.append(
                    f"| {name} | {len(tr)} | {f:.0%} ({cfg.pool_blocks}) | {row['vllm']} | "
                    f"{row['jaxkv']} | {row['calls']} | {row['matches']} | "
                    f"{row['first_mismatch']} | {row['evicted']} | {row['refused']} |"
                )
                print(lines[-1], flush=True)
    lines += ["", "| vLLM | jaxkv | evict calls | matching |", "|---|---|---|---|"]
    for (ref, peer), (calls, same) in total.items():
        lines.append(f"| {ref} | {peer} | {calls} | {same} ({same / max(calls, 1):.1%}) |")
    return "\n".join(lines)


# ---- replay ---------------------------------------------------------------------------------
def replay(quick: bool) -> str:
    tr = shipped()
    names = ("lru", "arc", "JaxkvLRU", "JaxkvARC", "KVLearnCachePolicy")
    lines = [
        "| pool | policy | hit rate | TTFT mean (ms) | TTFT p99 (ms) | transfer (GiB) | stored "
        "| evicted | evict calls | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in (0.1,) if quick else (0.1, 0.25, 0.5):
        cfg = ServingConfig(pool_blocks=int(f * tr.n_blocks), prefill_nodes=24)
        for r in vllm_replay.run(tr, names, cfg=cfg, cost=COST):
            lines.append(
                f"| {f:.0%} | {r['policy']} | {r['hit_rate']:.4f} | {r['ttft_ms_mean']:.0f} | "
                f"{r['ttft_ms_p99']:.0f} | {r['transfer_gib']:.0f} | {r['admits']} | "
                f"{r['evictions']} | {r['evict_calls']} | {r['wall_s']:.1f} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


# ---- per-call overhead ----------------------------------------------------------------------
def _policy(name: str, capacity: int):
    return vllm_replay.make_manager(name, pool_blocks=capacity)._policy


def _key(n: int):
    return vllm_replay.block_key(n)


def _request(policy, keys, hit: int, rid: int, *, n_evict: int) -> list[int]:
    """One request as vLLM's manager drives a policy, timed (ns): touch of the hits (vLLM's
    ``touch``), evict ``n_evict`` for the new keys, insert + complete, the request finish."""
    ctx = ReqContext(req_id=str(rid))
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 512)
    new = keys[hit:]
    t0 = time.perf_counter_ns()
    policy.touch(keys[:hit], ctx)
    t1 = time.perf_counter_ns()
    policy.on_store_miss(new, ctx)
    out = policy.evict(n_evict, set(new))
    t2 = time.perf_counter_ns()
    assert out is not None and len(out) == n_evict
    for i, k in enumerate(new):
        c = ChunkStatus(rid * 64 + i)
        policy.insert(k, c)
        c.ref_cnt = 0
        policy.mark_evictable(k)
    t3 = time.perf_counter_ns()
    policy.on_request_finished((tuple(keys),), set(new), set(keys[:hit]), ctx)
    t4 = time.perf_counter_ns()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]


def overhead(quick: bool, resident: int = 100_000, m: int = 32) -> str:
    rng = np.random.default_rng(0)
    iters = 300 if quick else 2000
    names = ("lru", "arc", "JaxkvLRU", "JaxkvARC", "KVLearnCachePolicy")
    lines = [
        f"{resident:,} resident blocks (the pool full), requests of {m} blocks whose first "
        "hit blocks reuse a resident request's prefix (hit ~ uniform 0..m-1; every request "
        f"stores its new blocks, so each evicts as many); {iters} timed requests after the "
        "fill; medians per block, µs.",
        "",
        "| policy | touch+evict per block | touch per hit block | evict per evicted block |"
        " insert per block | request finish per block | fill (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        pol = _policy(name, resident)
        chains, nxt = [], 0
        t0 = time.perf_counter()
        while nxt < resident:  # fill: requests of m new blocks
            keys = [_key(nxt + j) for j in range(m)]
            _request(pol, keys, 0, len(chains), n_evict=max(0, nxt + m - resident))
            nxt += m
            chains.append(keys)
        fill = time.perf_counter() - t0
        rows = []
        for it in range(iters):
            base = chains[int(rng.integers(max(0, len(chains) - resident // m), len(chains)))]
            hit = int(rng.integers(0, m))
            hit = next((h for h in range(hit) if pol.get(base[h]) is None), hit)
            keys = base[:hit] + [_key(nxt + j) for j in range(m - hit)]
            nxt += m - hit
            t = _request(pol, keys, hit, len(chains) + it, n_evict=m - hit)
            chains.append(keys)
            rows.append((t, hit, m - hit))

        def per(f, rows=rows):
            return statistics.median(v for t, h, n in rows if (v := f(t, h, n)) is not None)

        te = per(lambda t, h, n: (t[0] + t[1]) / 1e3 / max(h + n, 1))
        th = per(lambda t, h, n: t[0] / 1e3 / h if h else None)
        tv = per(lambda t, h, n: t[1] / 1e3 / n if n else None)
        ti = per(lambda t, h, n: t[2] / 1e3 / n if n else None)
        tf = per(lambda t, h, n: t[3] / 1e3 / (h + n))
        lines.append(
            f"| {name} | {te:.2f} | {th:.2f} | {tv:.2f} | {ti:.2f} | {tf:.2f} | {fill:.1f} |"
        )
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"Machine load average while measuring: {os.getloadavg()[0]:.1f} (2 cores).")
    return "\n".join(lines)


# ---- end to end ----------------------------------------------------------------------------
def _e2e_child(model_dir: str) -> None:
    """Builds a tiny Llama (random weights, a word-level tokenizer) and serves 6 prompts with
    vLLM's LLM on CPU, the OffloadingConnector and ``KVLearnCachePolicy``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    vocab = {f"w{i}": i for i in range(256)} | {"<unk>": 256, "<s>": 257, "</s>": 258}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    cfg = LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=257, eos_token_id=258,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    extra = {
        "cpu_bytes_to_use": 64 << 20,
        "eviction_policy": "KVLearnCachePolicy",
        "cache_policy_module_path": "jaxkv.kvlearn.integrations.vllm_policy",
    }
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        gpu_memory_utilization=0.3,  # on CPU: the share of host memory vLLM may reserve
        kv_transfer_config=ktc,
    )  # fmt: skip (the CPU attention backend needs block sizes that are multiples of 32)
    prompts = [" ".join(f"w{(i * 7 + j) % 256}" for j in range(200)) for i in range(3)] * 2
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    print("E2E OK", [o.outputs[0].text for o in outs])


def e2e(quick: bool) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--e2e-child", tmp]
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: a shared machine
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    log = out.stdout + out.stderr
    ok = re.search(r"E2E OK.*", log)
    cause = re.search(r"(?:Exception|Error): (.+)", log)
    lines = [f"exit status {out.returncode}; " + (ok.group(0) if ok else "failed")]
    if not ok:
        before = log[: cause.start()] if cause else log
        where = re.findall(r'File "[^"]*site-packages/(vllm/[^"]+)", line (\d+), in (\w+)', before)
        lines += ["", "Root cause (the first exception, raised in the worker):", ""]
        lines += [
            f"    {cause.group(1) if cause else log[-2000:]}",
            "",
            "Its innermost frames:",
            "",
        ]
        lines += [f"    {f}:{n} ({fn})" for f, n, fn in where[-5:]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cross-check", action="store_true")
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--e2e-child", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/kvlearn")
    args = ap.parse_args()
    if args.e2e_child:
        _e2e_child(args.e2e_child)
        return
    jobs = {
        "crosscheck": (args.cross_check, cross_check),
        "replay": (args.replay, replay),
        "overhead": (args.overhead, overhead),
    }
    everything = not any(on for on, _ in jobs.values()) and not args.e2e
    jobs["e2e"] = (args.e2e, e2e)
    for name, (on, fn) in jobs.items():
        if not (on or (everything and name != "e2e")):
            continue
        t0 = time.perf_counter()
        table = fn(args.quick)
        wall = time.perf_counter() - t0
        print(f"== {name}: {wall:.0f} s\n{table}", flush=True)
        if not args.quick:
            path = Path(args.out) / f"vllm_{name}.md"
            path.write_text(
                f"# vLLM KV-offload: {name}\n\n`{' '.join(['scripts/bench_vllm_policy.py'])} "
                f"--{name.replace('crosscheck', 'cross-check')}` ({wall:.0f} s, vllm-cpu "
                f"0.32.0)\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
