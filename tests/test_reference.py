"""Golden equivalence against transformers' PyTorch models (float32)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv import data as data_lib  # noqa: E402
from jaxkv import generate_tokens, kvcache  # noqa: E402
from jaxkv.eviction import Compression  # noqa: E402
from jaxkv.generate import teacher_forced  # noqa: E402
from jaxkv.model import decoder  # noqa: E402
from jaxkv.model.loading import embedded_model_path, load_model, load_safetensors  # noqa: E402
from jaxkv.policies import get_policy  # noqa: E402

SHAKESPEARE = data_lib.shipped_data_dir() / "tinyshakespeare"


def _tiny_mistral(tmp_path, *, n_heads, n_kv_heads, window):
    cfg = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=64 // n_heads,
        sliding_window=window,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms too, so that a swapped norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,window",
    [(4, 4, None), (4, 2, None), (4, 1, None), (4, 2, 7)],
    ids=["mha", "gqa", "mqa", "gqa-sliding-window"],
)
def test_tiny_mistral_logits_match_transformers(tmp_path, n_heads, n_kv_heads, window):
    model = _tiny_mistral(tmp_path, n_heads=n_heads, n_kv_heads=n_kv_heads, window=window)
    params, config = load_safetensors(tmp_path)
    assert config.sliding_window == window
    tokens = np.random.default_rng(0).integers(0, 128, (2, 20))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(decoder.forward(params, jnp.asarray(tokens), config=config))
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = embedded_model_path()
    except FileNotFoundError:
        pytest.skip("embedded model wheel not installed")
    ours = load_model("smollm2-135m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    return ours, ref


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_logits_and_greedy_tokens_match_transformers(smollm2):
    ours, ref = smollm2
    text = (SHAKESPEARE / "input.txt").read_text()[5000:7000]
    ids = ours.tokenizer(text)["input_ids"][:128]
    assert len(ids) == 128
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].numpy()
    logits = np.asarray(decoder.forward(ours.params, jnp.asarray([ids]), config=ours.config))[0]
    assert np.max(np.abs(logits - ref_logits)) <= 1e-3

    prompt = ids[:40]
    with torch.no_grad():
        ref_out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )[0, 40:].tolist()
    (out,) = generate_tokens(ours.params, [prompt], config=ours.config, max_new_tokens=32)
    assert out == ref_out


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_ratio_one_with_every_statistic_equals_full_cache_bit_for_bit(smollm2):
    """On the real model, computing every attention statistic must not change the logits:
    a softmax fused differently by XLA once statistics read it shifts logits by an ulp."""
    ours, _ = smollm2
    text = (SHAKESPEARE / "input.txt").read_text()[9000:11000]
    ids = jnp.asarray([ours.tokenizer(text)["input_ids"][:96]])
    full, _ = teacher_forced(ours.params, ids, prompt_len=64, config=ours.config)
    for name in ("h2o", "snapkv"):
        every = dataclasses.replace(get_policy(name), stats=kvcache.STAT_NAMES)
        comp = Compression(policy=every, ratio=1.0)
        logits, _ = teacher_forced(
            ours.params, ids, prompt_len=64, config=ours.config, compression=comp
        )
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(full))
