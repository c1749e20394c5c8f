"""The character bound on prompts: derived from the tokenizer, sound (no text has more counted
characters than its tokens can stand for), and off for tokenizer shapes that can drop or merge text.
And the work budget: what a request may ask the server to produce and return, over HTTP too."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pagedserve.entrypoints.openai.limits import (
    BODY_OVERHEAD_BYTES, DEFAULT_MAX_REQUEST_TOKENS, MAX_JSON_BYTES_PER_CHAR, PROMPT_CHARS_MARGIN, PromptBound,
    RequestWork, TokenBound, byte_level_symbols, default_max_body_bytes, prompt_bound, token_bound,
)

SMOLLM2_DROPS = "\x04\x06\x13\x14\x16\x1d"  # bytes missing from its vocabulary: they make no token


def test_the_embedded_tokenizers_bound(embedded_tokenizer):
    bound = token_bound(embedded_tokenizer)
    assert bound.max_chars == 81  # its longest vocabulary entry: a newline and 80 spaces
    # Sound: no token decodes to more characters than the bound.
    assert max(len(embedded_tokenizer.decode([i])) for i in range(len(embedded_tokenizer))) <= bound.max_chars
    # It has no unknown token: the bytes missing from its vocabulary vanish, and are not counted.
    assert bound.dropped == SMOLLM2_DROPS
    for c in SMOLLM2_DROPS:
        assert embedded_tokenizer.encode(c * 100, add_special_tokens=False) == []
    prompts = prompt_bound(embedded_tokenizer, 2048)
    assert prompts == PromptBound(2048 * 81 * PROMPT_CHARS_MARGIN, SMOLLM2_DROPS)
    assert prompts.counted("a\x1db\x04\x1d") == 2
    assert default_max_body_bytes(prompts.max_chars) == prompts.max_chars * MAX_JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES


def test_byte_level_symbols_are_the_tokenizers(embedded_tokenizer):
    symbols = byte_level_symbols()
    assert len(set(symbols)) == 256
    pre = embedded_tokenizer.backend_tokenizer.pre_tokenizer
    assert [pre.pre_tokenize_str(chr(b))[0][0] for b in range(128)] == symbols[:128]
    assert pre.pre_tokenize_str("\u00e9")[0][0] == symbols[0xC3] + symbols[0xA9]  # é is C3 A9


@pytest.fixture(scope="module")
def smollm2_bound(embedded_tokenizer) -> PromptBound:
    return prompt_bound(embedded_tokenizer, 1)  # one token's worth, margin included


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=300)
       | st.text(alphabet=st.sampled_from(SMOLLM2_DROPS + " a\u00e9\U0001F600"), max_size=200)
       | st.sampled_from([" " * 5000, "\n" + " " * 4000, "#" * 3000, "\u00e9" * 999, "\U0001F600" * 500]))
def test_no_text_has_more_counted_characters_than_its_tokens_can_hold(embedded_tokenizer, smollm2_bound, text):
    # The claim the bound rests on: counted(text) <= tokens * max_chars_per_token, so a text with
    # more than max_model_len * max_chars_per_token counted characters cannot fit max_model_len tokens.
    per_token = smollm2_bound.max_chars // PROMPT_CHARS_MARGIN
    assert smollm2_bound.counted(text) <= len(embedded_tokenizer.encode(text, add_special_tokens=False)) * per_token


class Fast:
    """Just what token_bound reads of a transformers fast tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.backend_tokenizer = tokenizer

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


VOCAB = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3, "abab": 4, "\u2581": 5}


def bpe(**kwargs) -> Tokenizer:
    return Tokenizer(models.BPE(VOCAB, [("a", "b"), ("ab", "ab")], **kwargs))


def byte_level() -> Tokenizer:
    """Byte-level BPE whose vocabulary holds every byte: it drops nothing."""
    t = Tokenizer(models.BPE({**{c: i for i, c in enumerate(byte_level_symbols())}, "[UNK]": 256, "ab": 257},
                             [("a", "b")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


def byte_level_without(missing: list[int]) -> Tokenizer:
    symbols = [c for b, c in enumerate(byte_level_symbols()) if b not in missing]
    t = Tokenizer(models.BPE({c: i for i, c in enumerate(symbols)}, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return t


def llama2_like() -> Tokenizer:
    t = bpe(unk_token="[UNK]", fuse_unk=True, byte_fallback=True)
    t.add_tokens([f"<0x{b:02X}>" for b in range(256)])
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    return t


def then_bytes(pre_tokenizer) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizer, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


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
    (bpe, None),  # no unknown token, characters as symbols: any character it does not know vanishes
    (lambda: byte_level_without([0x9F]), None),  # a continuation byte missing: whole characters can vanish
    (lambda: Tokenizer(models.WordPiece(VOCAB, unk_token="[UNK]")), None),  # a whole unknown word is one token
    (lambda: with_(byte_level(), pre_tokenizer=then_bytes(pre_tokenizers.Whitespace())), None),  # drops spaces
    (lambda: with_(byte_level(), pre_tokenizer=then_bytes(pre_tokenizers.Split(" ", "removed"))), None),
    (lambda: with_(byte_level(), pre_tokenizer=then_bytes(pre_tokenizers.Split(" ", "isolated"))), 5),  # Llama 3's
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
    bound = token_bound(Fast(make()))
    assert (bound and bound.max_chars) == expected


def test_a_tokenizer_it_cannot_inspect_has_no_bound():
    class Slow:
        def get_vocab(self):
            return {"a": 0}

    assert token_bound(Slow()) is None
    assert prompt_bound(Slow(), 2048) is None
    assert default_max_body_bytes(None) == 64 << 20


def test_bytes_missing_from_a_byte_level_vocabulary_are_not_counted():
    t = byte_level_without([0x1D, 0x04, 0xF5])  # 0xF5 never occurs in UTF-8
    assert t.encode("\x1d\x04").ids == []
    assert token_bound(Fast(t)) == TokenBound(1, "\x04\x1d")


# ---- the request work budget --------------------------------------------------------------------


def test_the_work_a_request_asks_for():
    assert RequestWork((5,), n=2, max_tokens=4).entries == 8
    assert RequestWork((5, 7), n=2, max_tokens=4, logprobs=2, echo=True).entries == 2 * ((4 + 5) * 3 + (4 + 7) * 3)
    assert RequestWork((5,), n=1, max_tokens=4, prompt_logprobs=1).entries == 4 + 5 * 2


def test_the_default_budget_refuses_the_amplified_request_and_admits_ordinary_ones():
    # 8 prompts of 1,000 tokens, n 128, echo, logprobs 20: a 53 KB body asking for a 567 MB answer.
    amplified = RequestWork((1000,) * 8, n=128, max_tokens=16, logprobs=20, echo=True)
    message, param = amplified.over(DEFAULT_MAX_REQUEST_TOKENS)
    assert param == "n" and str(amplified.entries) in message and str(DEFAULT_MAX_REQUEST_TOKENS) in message
    ordinary = [RequestWork((2000,), n=128, max_tokens=16384),  # the most choices, long answers
                RequestWork((100,), n=1, max_tokens=131072, logprobs=20),  # a whole long context, scored
                RequestWork((2048,) * 16, n=1, max_tokens=0, logprobs=5, echo=True),  # a loglikelihood batch
                RequestWork((8000,), n=1, max_tokens=1, prompt_logprobs=20)]
    assert all(work.over(DEFAULT_MAX_REQUEST_TOKENS) is None for work in ordinary)


def test_the_budget_over_http(server):
    """The amplified request is a 400 naming n, before any work; a request just under a budget passes
    and one token of work more is refused."""
    import httpx
    from server_harness import MODEL, serve

    from pagedserve.entrypoints.openai.api_server import build_app

    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [[100] * 1000] * 8, "n": 128, "max_tokens": 16, "echo": True, "logprobs": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "limit of 4194304" in r.json()["error"]["message"]

    completion = {"model": MODEL, "prompt": [100, 101, 102, 103, 104], "n": 2, "max_tokens": 4, "echo": True,
                  "logprobs": 2}  # 2 x (4 + 5) x (1 + 2) = 54
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 1}  # 3 x 3 x (1 + 1) = 18
    for budget, allowed in ((54, {"completions"}), (53, set()), (18, set()), (17, set())):
        with serve(build_app(server.async_engine, MODEL, max_request_tokens=budget)) as url:
            r = httpx.post(f"{url}/v1/completions", json=completion, timeout=60)
            assert r.status_code == (200 if "completions" in allowed else 400), r.text
            if r.status_code == 200:
                assert len(r.json()["choices"]) == 2
            else:  # the factor that inflates it most: 1 + logprobs 2 over n 2
                assert r.json()["error"]["param"] == "logprobs"
            r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
            assert r.status_code == (200 if budget >= 18 else 400), r.text
            if r.status_code == 400:
                assert r.json()["error"]["param"] == "n"


def test_a_json_response_is_serialized_off_the_event_loop(server, monkeypatch):
    """A large answer takes long to serialize: on the executor, /health and every stream go on meanwhile."""
    import threading

    import httpx
    from server_harness import MODEL

    from pagedserve.entrypoints.openai import serving_engine

    threads = []
    real = serving_engine.json_response

    def recorded(data):
        threads.append(threading.current_thread())
        return real(data)

    monkeypatch.setattr(serving_engine, "json_response", recorded)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and len(threads) == 1
    assert threads[0].name.startswith("pagedserve-tokenizer")  # the server's executor, not the loop's thread
