"""A Kimi-style tokenizer folder (tiktoken.model + tokenizer_config.json, no tokenizer.json): ktlite encodes and
decodes like the `tiktoken` package on the same ranks, pattern and special tokens, and renders the chat
template like transformers' renderer (the checkpoint's trust_remote_code class is not available offline)."""

from __future__ import annotations

import base64
import builtins
import json

import pytest
import tiktoken
from tiktoken._educational import bpe_train
from tokenizers import pre_tokenizers
from transformers.utils.chat_template_utils import render_jinja_template

from ktlite.runtime.tiktoken_tokenizer import DEFAULT_PATTERN, NUM_RESERVED_SPECIAL
from ktlite.runtime.tokenizer import Tokenizer

SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
TEMPLATE = (  # the shape of Kimi-K2's template: role markers, <|im_middle|>, <|im_end|>
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
TEXTS = ["Hello, world!", "  leading and trailing spaces  ", "line one\nline two\r\n\n  indented", "1234567 x 89",
         "你好，世界。混合 English 文本", "emoji 🙂👍🏽 and accents: Ünïcödé ✓", "it's they're we'll", "\t\t", ""]


# Pre-tokenization as Kimi-K2's tokenizer splits text (written down, not derived from ktlite's pattern): the first
# three are its published behaviour on mixed Han/Latin text; the rest follow by hand from the `pat_str` of the
# checkpoints' tokenization_kimi.py (letter runs keep their leading capital and a contraction, digits go in threes,
# a run of spaces gives all but its last space to the next word).
KIMI_SPLITS = {
    "中文English混合": ["中文", "English", "混合"],
    "汉字abc": ["汉字", "abc"],
    "北京市 Pascal": ["北京市", " Pascal"],
    "HelloWorld's": ["Hello", "World's"],
    "I'M don't": ["I'M", " don't"],
    "1234567": ["123", "456", "7"],
    "foo    bar": ["foo", "   ", " bar"],
    "a,\n\nb": ["a", ",\n\n", "b"],
}


def write_tiktoken_folder(folder, ranks: dict[bytes, int]) -> None:
    """A Kimi-style tokenizer folder: tiktoken.model (base64 token, rank per line) and tokenizer_config.json."""
    (folder / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r
                                                     for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    n = len(ranks)
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "add_bos_token": False, "chat_template": TEMPLATE,
              "added_tokens_decoder": {str(n + i): {"content": t, "special": True} for i, t in enumerate(SPECIAL)},
              "tokenizer_class": "TikTokenTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_pre_tokenization_matches_kimis_published_splits(tmp_path):
    """Ranks: the 256 bytes and each expected piece whole. BPE never merges across pre-tokenized pieces and cannot
    build a piece of 3+ bytes from single bytes without the ranks in between, so every piece comes back as one token
    exactly when the split regex cuts the text where Kimi's does; a wrong cut leaves byte tokens."""
    pieces = sorted({p.encode() for split in KIMI_SPLITS.values() for p in split if len(p.encode()) > 1})
    assert all(len(p) > 2 for p in pieces)  # two bytes could merge from two single-byte ranks
    ranks = {bytes([b]): b for b in range(256)} | {p: 256 + i for i, p in enumerate(pieces)}
    write_tiktoken_folder(tmp_path, ranks)
    tok, token_bytes = Tokenizer(tmp_path), {r: t for t, r in ranks.items()}
    for text, split in KIMI_SPLITS.items():
        assert [token_bytes[i].decode() for i in tok.encode(text)] == split, text


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    """(folder, the reference tiktoken.Encoding) with 400 BPE ranks trained here by tiktoken's own trainer."""
    folder = tmp_path_factory.mktemp("kimi_tok")
    docs = " ".join(d for d in (getattr(getattr(builtins, n), "__doc__", None) for n in sorted(dir(builtins)))
                    if isinstance(d, str))
    ranks = bpe_train(docs[:20000] + " 你好，世界。你好世界 Ünïcödé ✓", 400, DEFAULT_PATTERN, visualise=None)
    write_tiktoken_folder(folder, ranks)
    n = len(ranks)
    special = {t: n + i for i, t in enumerate(SPECIAL)}
    special.update({f"<|reserved_token_{i}|>": i for i in range(n + len(SPECIAL), n + NUM_RESERVED_SPECIAL)})
    return folder, tiktoken.Encoding("ref", pat_str=DEFAULT_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def test_round_trip_equals_tiktoken(kimi_tokenizer):
    folder, ref = kimi_tokenizer
    tok = Tokenizer(folder)
    assert tok.vocab_size == ref.n_vocab
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, allowed_special="all")
        assert tok.decode(ids) == text
    assert tok.bos_token_id == ref.encode_single_token("[BOS]") and tok.eos_token_ids == (ref.encode_single_token("[EOS]"),)
    assert tok.decode([tok.bos_token_id, *ref.encode("hi")], skip_special_tokens=False) == "[BOS]hi"
    assert tok.decode([tok.bos_token_id, *ref.encode("hi")]) == "hi"


def test_chat_template_renders_like_transformers(kimi_tokenizer):
    folder, ref = kimi_tokenizer
    tok = Tokenizer(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 there"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again?"}]
    want = render_jinja_template([messages], chat_template=TEMPLATE, add_generation_prompt=True)[0][0]
    assert tok.render_chat(messages) == want
    ids = tok.encode_chat(messages)
    assert ids == ref.encode(want, allowed_special="all")
    assert ids.count(ref.encode_single_token("<|im_end|>")) == 4  # the markers are single special tokens


def test_streaming_detokenization_and_byte_level_token_strings(kimi_tokenizer):
    folder, ref = kimi_tokenizer
    tok = Tokenizer(folder)
    text = "emoji 🙂👍🏽 你好，世界。"
    ids = tok.encode(text)
    stream = tok.detokenizer()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text
    # token strings in tokenizers' ByteLevel alphabet (what grammar engines read): the same string the
    # ByteLevel pre-tokenizer makes of the token's text, for every token that is whole UTF-8
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    checked = 0
    for i in range(ref.n_vocab - NUM_RESERVED_SPECIAL):
        try:
            piece = ref.decode_single_token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.id_to_token(i) == byte_level.pre_tokenize_str(piece)[0][0]
        checked += 1
    assert checked > 250  # all but the bytes >= 0x80 alone and pieces of multi-byte characters
    assert tok.id_to_token(ref.encode_single_token("<|im_user|>")) == "<|im_user|>"
    assert ref.encode_single_token("<|im_end|>") in tok.special_token_ids
