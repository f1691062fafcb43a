"""Tokenizers without transformers: ``tokenizers.Tokenizer`` + special tokens + chat template.

``ChatTokenizer.from_gguf`` builds the tokenizer a GGUF file describes in its metadata, the way
transformers' GGUF converter builds it (byte-level BPE; transformers is the reference in
tests/test_tokenizer.py). ``ChatTokenizer.from_dir`` reads a HF-style directory
(``tokenizer.json`` + ``tokenizer_config.json``), which is also what ``save`` writes. Nothing here
imports transformers or torch; the chat template needs ``jinja2``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import mmap
import struct
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The named special tokens, as in a HF ``tokenizer_config.json``."""

_CONFIG_FILE = "tokenizer_config.json"
_TEMPLATE_FILE = "chat_template.jinja"

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes per tokenizer.ggml.pre, as in transformers' GGUF converter (5.x); any other
# value gets GPT-2's (ByteLevel's own regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}


class TokenizerError(ValueError):
    """Tokenizer files are unreadable or describe a tokenizer this module cannot build."""


class UnsupportedTokenizer(TokenizerError):
    """A GGUF file's vocabulary is of a kind ``ChatTokenizer.from_gguf`` does not build."""


@dataclasses.dataclass(frozen=True, eq=False)
class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` with its named special tokens and chat template.

    Offers the part of the transformers tokenizer interface jaxkv uses: ``tok(text)["input_ids"]``,
    ``encode``, ``decode``, ``apply_chat_template``, ``convert_tokens_to_ids``, ``chat_template``
    and the ``*_token`` / ``*_token_id`` attributes.
    """

    backend: tokenizers.Tokenizer
    specials: dict[str, str | None]  # SPECIAL_NAMES -> token text (None when absent)
    chat_template: str | None = None

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> ChatTokenizer:
        """Builds the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Raises:
            UnsupportedTokenizer: the vocabulary is not byte-level BPE (``tokenizer.ggml.model``
                other than ``"gpt2"``).
            TokenizerError: the file is unreadable or its tokenizer metadata incomplete.
        """
        meta = read_gguf_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedTokenizer(
                f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is built "
                "without transformers"
            )
        try:
            tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
        except KeyError as e:
            raise TokenizerError(f"{path}: GGUF metadata {e.args[0]} is missing") from None
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        specials = {
            name: _token_at(tokens, meta.get(f"tokenizer.ggml.{key}_token_id"), path)
            for name, key in zip(SPECIAL_NAMES, ("bos", "eos", "unknown", "padding"), strict=True)
        }
        backend = _byte_level_bpe(tokens, merges, pre=meta.get("tokenizer.ggml.pre"))
        _add_gguf_tokens(backend, tokens, types, specials)
        backend.post_processor = _template_processor(
            backend,
            specials,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        )
        return cls(backend, specials, meta.get("tokenizer.chat_template"))

    @classmethod
    def from_dir(cls, directory: str | Path) -> ChatTokenizer:
        """Reads ``tokenizer.json`` and, when present, ``tokenizer_config.json`` and
        ``chat_template.jinja`` (the files ``save`` and transformers' ``save_pretrained`` write).

        The pipeline in ``tokenizer.json`` is used as written; an explicit ``add_bos_token`` /
        ``add_eos_token`` in the config replaces its post-processor, as transformers does.

        Raises:
            FileNotFoundError: no ``tokenizer.json``.
            TokenizerError: a file is not valid JSON or not a tokenizer.
        """
        directory = Path(directory)
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TokenizerError(f"{file} is not a tokenizers file: {e}") from None
        config = (
            _read_json(directory / _CONFIG_FILE) if (directory / _CONFIG_FILE).is_file() else {}
        )
        legacy = directory / "special_tokens_map.json"
        named = {**(_read_json(legacy) if legacy.is_file() else {}), **config}
        specials = {name: _token_text(named.get(name)) for name in SPECIAL_NAMES}
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit or backend.post_processor is None:
            backend.post_processor = _template_processor(
                backend,
                specials,
                add_bos=bool(config.get("add_bos_token", False)),
                add_eos=bool(config.get("add_eos_token", False)),
            )
        return cls(backend, specials, _dir_chat_template(directory, config))

    def save(self, directory: str | Path) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (specials, chat template)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {**self.specials, "chat_template": self.chat_template}
        (directory / _CONFIG_FILE).write_text(json.dumps(config, ensure_ascii=False, indent=1))

    # ---- the transformers-like surface -------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the post-processor adds BOS/EOS when ``add_special_tokens``)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict:
        """``{"input_ids": ids}`` for a text, or a list of id lists for a list of texts."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        batch = self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in batch]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (any int sequence, e.g. a numpy row)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **template_vars: Any,
    ) -> str | list[int]:
        """Renders a conversation with the chat template (ids when ``tokenize``).

        The template sees ``messages``, ``add_generation_prompt``, the named special tokens and
        ``template_vars``, in the sandboxed Jinja environment transformers uses.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        named = {name: tok for name, tok in self.specials.items() if tok is not None}
        text = _compile_template(self.chat_template).render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**named, **template_vars},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int] | None:
        """Id of a token (or of each token); ``unk_token_id`` for one not in the vocabulary."""
        if isinstance(tokens, str):
            tid = self.backend.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self.specials["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.specials["eos_token"]

    @property
    def unk_token(self) -> str | None:
        return self.specials["unk_token"]

    @property
    def pad_token(self) -> str | None:
        return self.specials["pad_token"]

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    def _id_of(self, name: str) -> int | None:
        token = self.specials[name]
        return None if token is None else self.backend.token_to_id(token)


# ---- GGUF --------------------------------------------------------------------------------------


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (arrays as lists), without reading its tensors.

    ``gguf.GGUFReader`` builds a numpy view per string, ~2 s for a 49k-token vocabulary; this
    reads the same values in a fraction of that.

    Raises:
        FileNotFoundError: no such file.
        TokenizerError: not a GGUF file (v2 or later), or truncated metadata.
    """
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise TokenizerError(f"{path} is not a GGUF file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with buf:
        if len(buf) < 24:
            raise TokenizerError(f"{path}: truncated GGUF header")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # as gguf checks
        version, _, n_kv = struct.unpack_from(order + "IQQ", buf, 4)
        if version < 2:
            raise TokenizerError(f"{path}: GGUF version {version} is not supported")
        cursor = _Cursor(buf, 24, order)
        try:
            return dict(cursor.key_value() for _ in range(n_kv))
        except (struct.error, ValueError) as e:  # ValueError: a bad type code or UTF-8
            raise TokenizerError(f"{path}: unreadable GGUF metadata ({e})") from None


@dataclasses.dataclass
class _Cursor:
    """Reads GGUF metadata values from ``buf`` starting at ``pos``."""

    buf: mmap.mmap
    pos: int
    order: str

    def key_value(self) -> tuple[str, Any]:
        key = self.string()
        return key, self.value(gguf.GGUFValueType(self.scalar("I")))

    def value(self, kind: gguf.GGUFValueType) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind == gguf.GGUFValueType.ARRAY:
            item, n = gguf.GGUFValueType(self.scalar("I")), self.scalar("Q")
            if item in _SCALAR_FORMATS:
                return list(self.unpack(f"{n}{_SCALAR_FORMATS[item]}"))
            return [self.value(item) for _ in range(n)]
        return self.scalar(_SCALAR_FORMATS[kind])

    def scalar(self, fmt: str) -> Any:
        return self.unpack(fmt)[0]

    def unpack(self, fmt: str) -> tuple:
        s = struct.Struct(self.order + fmt)
        out = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return out

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8")


def _token_at(tokens: list[str], index: int | None, path: Path) -> str | None:
    if index is None:
        return None
    if not 0 <= index < len(tokens):
        raise TokenizerError(f"{path}: special token id {index} is outside the vocabulary")
    return tokens[index]


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in kept}
    table.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in table)})
    return table


def _byte_level_bpe(tokens: list[str], merges: list[str], *, pre: str | None):
    """GPT-2-style BPE; a token spelled outside the byte alphabet is respelled in it."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def respell(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {respell(t): i for i, t in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ")) for m in merges],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = tokenizers.Tokenizer(bpe)
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_gguf_tokens(backend, tokens: list[str], types: list[int], specials: dict) -> None:
    """Control tokens (and the named specials) become special added tokens, user-defined ones
    plain added tokens, so that text never cuts them into pieces.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel and is skipped
    (adding it would grow the vocabulary past the model's), as transformers does.
    """
    alphabet = set(_byte_alphabet().values())
    control = [
        t for t, k in zip(tokens, types, strict=True) if k == _CONTROL and set(t) <= alphabet
    ]
    named = [t for t in specials.values() if t is not None and t not in control]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control + named)]
    )
    vocab = backend.get_vocab()
    user = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _template_processor(backend, specials: dict, *, add_bos: bool, add_eos: bool):
    """The post-processor transformers sets for ``add_bos_token`` / ``add_eos_token``."""
    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = (
        f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    )
    used = [bos] * add_bos + [eos] * add_eos
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in used]
    )


# ---- HF directories ----------------------------------------------------------------------------


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: text or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _dir_chat_template(directory: Path, config: dict) -> str | None:
    """``chat_template.jinja`` when present (it wins, as in transformers), else the config's."""
    if (directory / _TEMPLATE_FILE).is_file():
        return (directory / _TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # the older list of named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---- chat templates ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    """The template compiled in transformers' sandbox (trimmed blocks, loop controls, tojson)."""
    try:
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not want
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
