"""Tokenizer, chat templates in both dialects, and streaming detokenization."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import transformers

from ktlite.errors import RequestError
from ktlite.runtime.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "你好 ✓ Ünïcödé?"},
]


def test_chat_template_matches_transformers(tiny_v3):
    ours = Tokenizer(tiny_v3)
    ref = transformers.AutoTokenizer.from_pretrained(tiny_v3)
    expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(MESSAGES) == expected
    assert ours.encode_chat(MESSAGES) == ref(expected, add_special_tokens=False)["input_ids"]
    assert ours.encode_chat(MESSAGES)[0] == ours.bos_token_id
    assert ours.encode_chat(MESSAGES).count(ours.bos_token_id) == 1


def test_chat_template_jinja_file_dialect(tiny_v3, tmp_path):
    """Folders re-saved by recent transformers keep the template in chat_template.jinja."""
    for f in ("tokenizer.json",):
        shutil.copy(tiny_v3 / f, tmp_path / f)
    config = json.loads((tiny_v3 / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(template)
    assert Tokenizer(tmp_path).render_chat(MESSAGES) == Tokenizer(tiny_v3).render_chat(MESSAGES)


def test_named_template_list_dialect(tiny_v3, tmp_path):
    shutil.copy(tiny_v3 / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_v3 / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": config["chat_template"]}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(tmp_path).render_chat(MESSAGES) == Tokenizer(tiny_v3).render_chat(MESSAGES)


def test_template_errors_become_request_errors(tiny_v3):
    with pytest.raises(RequestError, match="unknown role"):
        Tokenizer(tiny_v3).render_chat([{"role": "wizard", "content": "x"}])


def test_template_is_sandboxed(tiny_v3, tmp_path):
    shutil.copy(tiny_v3 / "tokenizer.json", tmp_path / "tokenizer.json")
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    with pytest.raises(Exception, match="unsafe|not safely"):
        Tokenizer(tmp_path).render_chat(MESSAGES)


def test_plain_prompt_gets_one_bos(tiny_v3):
    tok = Tokenizer(tiny_v3)
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "Hello world"
    assert tok.eos_token_ids and tok.eos_token_ids[0] == tok._tok.token_to_id("<｜end▁of▁sentence｜>")


@pytest.mark.parametrize("seed", range(5))
def test_streaming_detokenization_concatenates_to_full_decode(tiny_v3, seed):
    """Random ids split multi-byte characters anywhere; the deltas must still add up exactly."""
    tok = Tokenizer(tiny_v3)
    rng = random.Random(seed)
    prompt = [rng.randrange(tok.vocab_size) for _ in range(5)]
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
    detok = tok.detokenizer(prompt)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)


def test_streaming_multibyte_text_is_not_split(tiny_v3):
    tok = Tokenizer(tiny_v3)
    sentence = "Emoji 🎉 and 你好世界, ✓ Ünïcödé done."
    ids = tok.encode(sentence, add_bos=False)
    detok = tok.detokenizer()
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == sentence
    assert all("\ufffd" not in d for d in deltas)
