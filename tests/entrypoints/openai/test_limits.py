"""The character bound on prompts: derived from the tokenizer, sound (no text of more characters
than its tokens can stand for), and off for tokenizer shapes that can drop or merge text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pagedserve.entrypoints.openai.limits import (
    BODY_OVERHEAD_BYTES, MAX_JSON_BYTES_PER_CHAR, PROMPT_CHARS_MARGIN, default_max_body_bytes, max_chars_per_token,
    max_prompt_chars,
)


def test_the_embedded_tokenizers_bound(embedded_tokenizer):
    per_token = max_chars_per_token(embedded_tokenizer)
    assert per_token == 81  # its longest vocabulary entry: a newline and 80 spaces
    # Sound: no token decodes to more characters than the bound.
    assert max(len(embedded_tokenizer.decode([i])) for i in range(len(embedded_tokenizer))) <= per_token
    chars = max_prompt_chars(embedded_tokenizer, 2048)
    assert chars == 2048 * 81 * PROMPT_CHARS_MARGIN
    assert default_max_body_bytes(chars) == chars * MAX_JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES


@settings(max_examples=50, deadline=None)
@given(text=st.text(min_size=1, max_size=300)
       | st.sampled_from([" " * 5000, "\n" + " " * 4000, "#" * 3000, "é" * 999, "\U0001F600" * 500]))
def test_no_text_has_more_characters_than_its_tokens_can_hold(embedded_tokenizer, text):
    # The claim the bound rests on: len(text) <= tokens * max_chars_per_token, so a text over
    # max_model_len * max_chars_per_token characters cannot fit max_model_len tokens.
    per_token = max_chars_per_token(embedded_tokenizer)
    assert len(text) <= len(embedded_tokenizer.encode(text, add_special_tokens=False)) * per_token


class Fast:
    """Just what max_chars_per_token reads of a transformers fast tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.backend_tokenizer = tokenizer

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


VOCAB = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3, "abab": 4, "\u2581": 5}


def bpe(**kwargs) -> Tokenizer:
    return Tokenizer(models.BPE(VOCAB, [("a", "b"), ("ab", "ab")], **kwargs))


def byte_level() -> Tokenizer:
    t = bpe()
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


def llama2_like() -> Tokenizer:
    t = bpe(unk_token="[UNK]", fuse_unk=True, byte_fallback=True)
    t.add_tokens([f"<0x{b:02X}>" for b in range(256)])
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    return t


def with_(t: Tokenizer, **parts) -> Tokenizer:
    for name, value in parts.items():
        setattr(t, name, value)
    return t


def with_added(t: Tokenizer, token: AddedToken) -> Tokenizer:
    t.add_special_tokens([token])
    return t


@pytest.mark.parametrize(("make", "expected"), [
    (byte_level, 5),  # the longest entry, "[UNK]"
    (llama2_like, 6),  # "<0x00>": byte fallback, so no unknown token ever covers a run of text
    (lambda: bpe(unk_token="[UNK]", fuse_unk=False), 5),  # one unknown token per unknown character
    (lambda: bpe(unk_token="[UNK]", fuse_unk=True), None),  # a run of unknown characters is one token
    (lambda: Tokenizer(models.WordPiece(VOCAB, unk_token="[UNK]")), None),  # a whole unknown word is one token
    (lambda: with_(byte_level(), pre_tokenizer=pre_tokenizers.Whitespace()), None),  # drops whitespace
    (lambda: with_(byte_level(), pre_tokenizer=pre_tokenizers.Split(" ", "removed")), None),
    (lambda: with_(byte_level(), pre_tokenizer=pre_tokenizers.Split(" ", "isolated")), 5),
    (lambda: with_(byte_level(), normalizer=normalizers.BertNormalizer()), None),  # strips accents, controls
    (lambda: with_(byte_level(), normalizer=normalizers.Strip()), None),
    (lambda: with_(byte_level(), normalizer=normalizers.NFKC()), None),  # composes characters
    (lambda: with_(byte_level(), normalizer=normalizers.Replace("  ", " ")), None),
    (lambda: with_(byte_level(), normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])), 5),
    (lambda: with_added(byte_level(), AddedToken("<|very_long_special_token|>", special=True)),
     len("<|very_long_special_token|>")),  # an added token matches its whole text
    (lambda: with_added(byte_level(), AddedToken("<mask>", lstrip=True, special=True)), None),  # eats spaces
])
def test_tokenizer_shapes(make, expected):
    assert max_chars_per_token(Fast(make())) == expected


def test_a_tokenizer_it_cannot_inspect_has_no_bound():
    class Slow:
        def get_vocab(self):
            return {"a": 0}

    assert max_chars_per_token(Slow()) is None
    assert max_prompt_chars(Slow(), 2048) is None
    assert default_max_body_bytes(None) == 64 << 20
