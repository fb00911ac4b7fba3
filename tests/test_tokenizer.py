"""Tokenizer, chat template and streaming detokenization on the real SmolLM2 vocabulary."""

from __future__ import annotations

import pytest

from streamgrok.model.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.integration

MIXED = [
    "Hello, world! The year 2026 has 365 days.",
    "  leading spaces,\ttabs\nand new lines\n\n",
    "Ünïcödé façade, naïve café — «quotes» 日本語のテキスト 👩‍🚀🚀",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]


@pytest.mark.parametrize("text", MIXED)
def test_round_trip(smollm2, text):
    tok = smollm2.tokenizer
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_digits_are_split_and_specials_recognised(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("<|im_start|>12345")
    assert ids[0] == 1  # <|im_start|> is one control token
    assert [tok.decode([i]) for i in ids[1:]] == list("12345")
    assert tok.eos_id == 2 and 2 in tok.stop_ids


def test_chat_template_two_turns(smollm2):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ]
    assert smollm2.tokenizer.render_chat(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_detokenizer_never_splits_characters(smollm2):
    tok = smollm2.tokenizer
    text = "Café 日本語 👩‍🚀 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 3  # it streams, not one blob at the end
