"""ChatTokenizer: GGUF metadata, tiny hermetic tokenizers, and the embedded SmolLM2 against
transformers' own GGUF tokenizer (ids, decoding, chat template), loading without torch."""

import json
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

from jaxkv.generate import stop_token_ids
from jaxkv.model import loading
from jaxkv.model.tokenizer import (
    ChatTokenizer,
    TokenizerError,
    UnsupportedTokenizer,
    read_gguf_metadata,
)

MIXED = (
    "def fib(n: int) -> int:\n"
    '\t"""It\'s the n-th Fibonacci number; we\'ll see."""\n'
    "    if n < 2:\n        return n  # base case\n"
    "    return fib(n - 1) + fib(n - 2)\n\n\n"
    "x = {'a': [1, 2, 3], \"b\": (4.5e-3, 0x1F)}; y = x['a'][-1] != 3 && true || !false\n"
    "Digits: 1234567890123 and 3.14159265, 1,000,000, 2024-01-31, +49 (0)30 1234-567.\n"
    "Unicode: café naïve résumé Ελληνικά Привет мир 日本語のテキスト 中文字符 한국어 "
    "e\u0301 \u00a0nbsp \u3000ideographic space 🤗👍🏽👨\u200d👩\u200d👧 🇫🇷\n"
    "Whitespace:\t\ttabs,    four spaces,  two,\r\nCRLF, trailing   \n \n\n"
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|><repo_name>"
    " <|im_start unfinished <|im_end|>x I'M HERE, you're THERE.   "
)
TEXTS = [MIXED, "", " ", "Hi", "  leading", "trailing\n\n", "1234567890123", "🤗", "<|im_end|>"]

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Hi"}],
    "system_one_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke\nabout  cats."},
    ],
    "system_multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, 日本語 please 🤗"},
    ],
}


# ---- GGUF metadata and tiny hermetic tokenizers -------------------------------------------------


def write_gguf(path, *, endian=gguf.GGUFEndian.LITTLE, model="gpt2", pre="default", add_bos=False):
    """A tensor-less GGUF with a tiny byte-level vocabulary: bytes, "Ġa", "ab", a control token
    "<|end|>", a user-defined token "<tool>" and a token with a raw space ("x y")."""
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]
    tokens = ["<|end|>", *alphabet, "Ġa", "ab", "<tool>", "x y"]
    types = [3] + [1] * (len(alphabet) + 2) + [4, 1]
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ a", "a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    w.add_float32("test.float", 0.25)
    w.add_array("test.ints", [-1, 2, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_gguf_metadata_equals_gguf_reader(tmp_path, endian):
    file = tmp_path / "tiny.gguf"
    write_gguf(file, endian=endian)
    expected = {k: f.contents() for k, f in gguf.GGUFReader(file).fields.items()}
    expected = {k: v for k, v in expected.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(file) == expected
    assert expected["test.ints"] == [-1, 2, 3] and expected["test.float"] == 0.25


def test_gguf_metadata_errors(tmp_path):
    file = tmp_path / "tiny.gguf"
    write_gguf(file)
    (tmp_path / "cut.gguf").write_bytes(file.read_bytes()[:200])
    with pytest.raises(TokenizerError, match="cut.gguf: unreadable GGUF metadata"):
        read_gguf_metadata(tmp_path / "cut.gguf")
    (tmp_path / "header.gguf").write_bytes(file.read_bytes()[:12])
    with pytest.raises(TokenizerError, match="truncated GGUF header"):
        read_gguf_metadata(tmp_path / "header.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf file at all")
    with pytest.raises(TokenizerError, match="is not a GGUF file"):
        read_gguf_metadata(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(TokenizerError, match="is not a GGUF file"):
        read_gguf_metadata(tmp_path / "empty.gguf")
    with pytest.raises(FileNotFoundError):
        read_gguf_metadata(tmp_path / "absent.gguf")


def test_tiny_gguf_tokenizer(tmp_path):
    file = tmp_path / "tiny.gguf"
    tokens = write_gguf(file)
    tok = ChatTokenizer.from_gguf(file)
    ids = {t: i for i, t in enumerate(tokens)}
    assert tok.encode("ab a<|end|><tool>") == [ids["ab"], ids["Ġa"], ids["<|end|>"], ids["<tool>"]]
    assert tok.convert_tokens_to_ids("xĠy") == ids["x y"]  # respelled in the byte alphabet
    assert tok.decode([ids["x y"]]) == "x y"
    assert tok.decode(tok.encode("ab<|end|><tool>"), skip_special_tokens=True) == "ab<tool>"
    assert tok.eos_token == "<|end|>" and tok.eos_token_id == 0 and tok.pad_token_id is None
    assert tok.convert_tokens_to_ids(["ab", "zz"]) == [ids["ab"], None]  # no unk token
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == (
        "[user] ab\n"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}])[:3] == tok.encode("[us")


def test_tiny_gguf_add_bos(tmp_path):
    file = tmp_path / "tiny.gguf"
    write_gguf(file, add_bos=True)
    tok = ChatTokenizer.from_gguf(file)
    assert tok.encode("ab") == [0, tok.convert_tokens_to_ids("ab")]
    assert tok.encode("ab", add_special_tokens=False) == [tok.convert_tokens_to_ids("ab")]
    tok.save(tmp_path / "saved")
    assert ChatTokenizer.from_dir(tmp_path / "saved").encode("ab") == tok.encode("ab")


def test_tiny_gguf_equals_transformers_converter(tmp_path):
    """The pipeline transformers' GGUF converter builds, for every pre-tokenizer it knows, except
    the token "<|endoftext|>" it appends when the file lacks one (GPT2Tokenizer's default, an id
    past the model's vocabulary)."""
    converter = pytest.importorskip("transformers.integrations.gguf")
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for pre in ["default", "smollm", *mapping.GGUF_PRE_TOKENIZER_SPLITS]:
        file = tmp_path / f"{pre}.gguf"
        tokens = write_gguf(file, pre=pre)
        built = converter.convert_gguf_tokenizer(*converter.get_gguf_tokenizer(str(file))[:2])
        want = json.loads(built[0].to_str())
        want["added_tokens"] = [t for t in want["added_tokens"] if t["id"] < len(tokens)]
        assert json.loads(ChatTokenizer.from_gguf(file).backend.to_str()) == want, pre


def test_unsupported_gguf_vocabulary(tmp_path):
    file = tmp_path / "spm.gguf"
    write_gguf(file, model="llama")
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.model='llama'"):
        ChatTokenizer.from_gguf(file)


def test_from_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        ChatTokenizer.from_dir(tmp_path)


# ---- the embedded SmolLM2 tokenizer against transformers' ---------------------------------------


@pytest.fixture(scope="module")
def embedded():
    try:
        return loading.embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(embedded):
    return ChatTokenizer.from_gguf(embedded)


@pytest.fixture(scope="module")
def reference(embedded):
    """transformers' tokenizer from the same GGUF (its GGUF reader needs torch)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    return transformers.AutoTokenizer.from_pretrained(
        str(embedded.parent), gguf_file=embedded.name, local_files_only=True
    )


@pytest.mark.model
def test_load_tokenizer_is_ours(embedded):
    assert isinstance(loading.load_tokenizer(embedded), ChatTokenizer)


@pytest.mark.model
@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_equal_transformers(ours, reference, text, add_special_tokens):
    want = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert ours(text, add_special_tokens=add_special_tokens)["input_ids"] == want
    assert ours.encode(text, add_special_tokens=add_special_tokens) == want


@pytest.mark.model
def test_mixed_text_keeps_special_tokens_whole(ours):
    ids = ours.encode(MIXED)
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"):
        assert ours.convert_tokens_to_ids(token) in ids
    assert ours(["Hi", MIXED])["input_ids"] == [ours.encode("Hi"), ids]


@pytest.mark.model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(ours, reference, skip_special_tokens):
    ids = ours.encode(MIXED)
    got = ours.decode(ids, skip_special_tokens=skip_special_tokens)
    assert got == reference.decode(ids, skip_special_tokens=skip_special_tokens)
    if not skip_special_tokens:
        assert got == MIXED
    # arbitrary ids, including byte tokens that cut UTF-8 sequences
    rows = np.random.default_rng(0).integers(0, len(ours), size=(20, 17))
    for row in rows:
        want = reference.decode(row.tolist(), skip_special_tokens=skip_special_tokens)
        assert ours.decode(row, skip_special_tokens=skip_special_tokens) == want


@pytest.mark.model
def test_specials_equal_transformers(ours, reference):
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token") == getattr(reference, f"{name}_token")
        assert getattr(ours, f"{name}_token_id") == getattr(reference, f"{name}_token_id")
    assert ours.chat_template == reference.chat_template and len(ours) == len(reference)
    for token in ("<|im_end|>", "<|eot_id|>", "</s>", "Hello", "ĠHello"):
        assert ours.convert_tokens_to_ids(token) == reference.convert_tokens_to_ids(token)
    assert stop_token_ids(ours) == stop_token_ids(reference) == (2,)


@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_template_equals_transformers(ours, reference, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == reference.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == ours.encode(
        text, add_special_tokens=False
    )
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.model
def test_save_round_trip(ours, reference, tmp_path):
    ours.save(tmp_path / "ours")
    again = ChatTokenizer.from_dir(tmp_path / "ours")
    assert json.loads(again.backend.to_str()) == json.loads(ours.backend.to_str())
    assert again.specials == ours.specials and again.chat_template == ours.chat_template
    # both directions with transformers' directory format
    reference.save_pretrained(str(tmp_path / "theirs"))
    theirs = loading.load_tokenizer(tmp_path / "theirs")
    assert isinstance(theirs, ChatTokenizer) and theirs.specials == ours.specials
    assert theirs.chat_template == ours.chat_template and theirs.encode(MIXED) == ours.encode(MIXED)
    auto = pytest.importorskip("transformers").AutoTokenizer
    from_ours = auto.from_pretrained(str(tmp_path / "ours"), local_files_only=True)
    assert from_ours(MIXED)["input_ids"] == ours.encode(MIXED)
    assert from_ours.eos_token_id == ours.eos_token_id


# ---- the README's first command on a machine without torch ------------------------------------

NO_TORCH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["torch"] = None  # `import torch` fails, as on a machine without it
    import jaxkv
    from jaxkv.model import loading

    first = jaxkv.load("smollm2-135m")  # empty cache: dequantizes and writes the cache
    loading._gguf_numpy = None  # the second load must come from the cache
    second = jaxkv.load("smollm2-135m")
    out = jaxkv.generate(first, "Hi", max_new_tokens=3)
    again = jaxkv.generate(second, "Hi", max_new_tokens=3)
    text = sys.stdin.buffer.read().decode()  # bytes: text mode would turn CRLF into LF
    print(json.dumps({
        "out": out, "again": again,
        "ids": [m.tokenizer.encode(text, add_special_tokens=a) for m in (first, second)
                for a in (True, False)],
        "cached": [p.name for p in loading.cache_dir().iterdir()],
        "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
    }))
    """
)


@pytest.mark.model
@pytest.mark.slow
def test_load_and_generate_without_torch(embedded, ours, tmp_path):
    env = {**os.environ, "JAXKV_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT],
        input=MIXED.encode(),
        capture_output=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert result["out"][0].strip() and result["again"] == result["out"]
    want = [ours.encode(MIXED), ours.encode(MIXED, add_special_tokens=False)]
    assert result["ids"] == want * 2  # first load, and the second from the cache
    assert len(result["cached"]) == 1 and result["transformers"] == []
