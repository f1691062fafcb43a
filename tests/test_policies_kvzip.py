"""``kvzip``: context-reconstruction scores against the numpy reference decoder, the tokens it
keeps, r = 1, and the places it cannot run."""

import jax
import numpy as np
import pytest
from np_reference import RefModel

from jaxkv import eviction, kvcache
from jaxkv.cli import eval as eval_lib
from jaxkv.config import ModelConfig
from jaxkv.evals import fidelity, report
from jaxkv.evals.runner import ByteTokenizer, EvalModel, PolicyGroup
from jaxkv.eviction import Compression
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import TIER, get_policy
from jaxkv.policies import kvzip as kvzip_lib

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
MODEL = EvalModel("tiny", CFG, PARAMS, ByteTokenizer(), stop_tokens=(0,), pad_id=0)
PROMPT = 12
WINDOWS = np.asarray(jax.random.randint(jax.random.key(1), (2, 20), 1, 256), np.int32)


@pytest.fixture(scope="module")
def state():
    return fidelity.window_state(MODEL, get_policy("kvzip"), WINDOWS, PROMPT)


class TemplateTokenizer(ByteTokenizer):
    """A byte tokenizer with a ChatML chat template (SmolLM2's turn markers)."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt):
        assert not tokenize
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _text(ids) -> str:
    return bytes(ids.tolist()).decode()


def test_the_repeat_request_is_kvpress_prompt_and_a_newline_without_a_template():
    ids = fidelity.repeat_ids(ByteTokenizer())
    assert _text(ids) == kvzip_lib.REPEAT_PROMPT + "\n"


def test_the_chat_request_ends_with_the_templates_assistant_header():
    """``plain`` (the default) is kvpress's request without a template whatever the tokenizer;
    ``chat`` is kvpress's with one: the template's text between a user's message and the
    assistant's answer."""
    tok = TemplateTokenizer()
    assert _text(fidelity.repeat_ids(tok)) == kvzip_lib.REPEAT_PROMPT + "\n"
    chat = _text(fidelity.repeat_ids(tok, "chat"))
    assert chat == kvzip_lib.REPEAT_PROMPT + "<|im_end|>\n<|im_start|>assistant\n"
    assert _text(fidelity.repeat_ids(ByteTokenizer(), "chat")) == kvzip_lib.REPEAT_PROMPT + "\n"
    with pytest.raises(ValueError, match="request must be one of"):
        fidelity.repeat_ids(tok, "json")


def test_the_request_reaches_the_reconstruction_pass():
    """``window_state``'s scores are those of a pass over prompt + the request + prompt."""
    model = EvalModel("tiny", CFG, PARAMS, TemplateTokenizer(), stop_tokens=(0,), pad_id=0)
    scores = {}
    for request in kvzip_lib.REQUESTS:
        got = fidelity.window_state(model, get_policy("kvzip"), WINDOWS, PROMPT, request)
        want = fidelity.prompt_reconstruction(
            PARAMS,
            WINDOWS[:, :PROMPT],
            fidelity.repeat_ids(model.tokenizer, request),
            config=CFG,
        )
        np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))
        scores[request] = np.asarray(got.scores)
    assert not np.array_equal(scores["plain"], scores["chat"])
    with pytest.raises(ValueError, match="kvzip_request must be one of"):
        fidelity.FidelitySettings(kvzip_request="json")


def test_scores_are_the_most_attention_a_reconstruction_query_pays(state):
    """Sequence 0 against the numpy decoder: feed prompt, repeat request and the prompt again
    token by token under the full cache; each prompt position's score is the largest ``attn``
    (group mean) of any reconstruction query (sinks are the policy's, not the state's)."""
    toks = WINDOWS[0, :PROMPT].tolist()
    stream = toks + fidelity.repeat_ids(ByteTokenizer()).tolist() + toks
    L, K = CFG.n_layers, CFG.n_kv_heads
    ref = RefModel(PARAMS, CFG)
    ref.run_pass(
        np.asarray(toks), list(range(PROMPT)), {(l, k): [] for l in range(L) for k in range(K)}
    )
    best = np.zeros((L, K, PROMPT))
    for p in range(PROMPT, len(stream)):
        seen = {(l, k): list(range(p)) for l in range(L) for k in range(K)}
        ref.run_pass(np.asarray(stream[p : p + 1]), [p], seen)
        for l in range(L):
            for k in range(K):
                row = [ref.stats[(l, k, q)]["attn"] for q in range(PROMPT)]
                best[l, k] = np.maximum(best[l, k], row)
    assert state.scores.shape == (L, 2, K, PROMPT)
    np.testing.assert_allclose(np.asarray(state.scores)[:, 0], best, atol=2e-6, rtol=0)


@pytest.mark.parametrize("budget", [6, 9])
def test_kvzip_keeps_each_rows_best_reconstruction_scores(state, budget):
    comp = Compression.make("kvzip", budget=budget, granularity="head", protocol="prefill")
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT)
    _, cache = decoder.prefill(PARAMS, WINDOWS[:, :PROMPT], cache, config=CFG)
    kept = eviction.evict(cache, comp, state, key=None)
    sink = np.arange(PROMPT) < kvzip_lib.N_SINK  # the first four positions, above every other
    scores = np.where(sink, TIER + np.asarray(state.scores), np.asarray(state.scores))
    for l in range(CFG.n_layers):
        for b in range(2):
            for k in range(CFG.n_kv_heads):
                got = {int(p) for p in kept.pos[l, b, k] if p >= 0}
                assert got == set(np.argsort(-scores[l, b, k])[:budget].tolist())
                assert set(range(kvzip_lib.N_SINK)) <= got


def _kl(ratio, tmp_path, **selection):
    selection = {"granularity": "head", **selection}
    settings = fidelity.FidelitySettings(
        prompt_len=PROMPT, batch_size=2, min_budget=4, protocol="prefill", **selection
    )
    groups = [PolicyGroup(n, (get_policy(n),)) for n in ("kvzip", "streaming_llm")]
    store = report.ResultStore(
        tmp_path,
        "fid",
        model="tiny",
        config={},
        summarize=fidelity.summarize,
        render=fidelity.render,
    )
    rows = fidelity.run(
        MODEL,
        groups,
        ratios=[ratio],
        seeds=[0],
        windows_NT=WINDOWS,
        settings=settings,
        store=store,
    )
    return {r["policy"]: r["kl_mean"] for r in rows}


def test_r_one_is_the_full_cache_and_compression_costs_something(tmp_path):
    assert _kl(1.0, tmp_path)["kvzip"] == 0.0
    assert _kl(0.34, tmp_path)["kvzip"] > 0.0
    # KVzip's own allocation: one pool over every row, no floor, no cap (no memory saved)
    pooled = _kl(0.34, tmp_path, granularity="global", head_floor=0.0, head_cap=8.0)
    assert pooled["kvzip"] > 0.0


def test_kvzip_runs_only_in_the_prefill_protocol_of_fidelity(tmp_path):
    with pytest.raises(ValueError, match="only the fidelity evaluation"):
        get_policy("kvzip").init()
    common = ["--model", "tiny", "--out", str(tmp_path / "x")]
    assert eval_lib.main(["fidelity", "--policies", "kvzip", *common]) == 2  # decode protocol
    prefill = ["fidelity", "--policies", "kvzip", "--protocol", "prefill", *common]
    assert eval_lib.main([*prefill, "--head-cap", "4"]) == 2  # needs a pooled granularity
    assert eval_lib.main([*prefill, "--evict-every", "4"]) == 2  # the decode protocol only
    assert eval_lib.main(["retrieval", "--policies", "full,kvzip", *common]) == 2
    assert (
        eval_lib.main(["generate", "--model", "tiny", "--prompt", "hi", "--policy", "kvzip"]) == 2
    )
    with pytest.raises(ValueError, match="critical: wraps a scoring policy"):
        get_policy("critical:kvzip")
    assert not (tmp_path / "x").exists()
