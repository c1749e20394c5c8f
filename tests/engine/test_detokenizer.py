import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedserve.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE = "Héllo wörld! 日本語のテキスト 🎉🦜👩‍👩‍👧 naïve café, ñandú; Ελληνικά, кириллица."
IM_START, IM_END = 1, 2


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, chunk=1, prompt=(), **kw):
    """Feeds ids `chunk` at a time; returns (detokenizer, deltas including finish())."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return detok, deltas


def assert_consistent(detok, deltas):
    assert "".join(deltas) == detok.text
    # A broken character may show only where the tokens themselves decode to one.
    if REPLACEMENT not in detok.text:
        assert not any(REPLACEMENT in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.\n\n  Indented   spaces\tand tabs.",
    MULTIBYTE,
    "🎉" * 5 + "字" * 5 + "é" * 5,
])
def test_deltas_concatenate_to_decode(embedded_tokenizer, text, chunk):
    tok = embedded_tokenizer
    ids = encode(tok, text)
    detok, deltas = stream(tok, ids, chunk=chunk, prompt=encode(tok, "<|im_start|>assistant\n"))
    assert_consistent(detok, deltas)
    assert detok.text == tok.decode(ids) == text
    assert detok.stop_matched is None


def test_multibyte_characters_really_span_tokens(embedded_tokenizer):
    # Makes the test above meaningful: some single tokens decode to a broken character.
    tok = embedded_tokenizer
    assert any(REPLACEMENT in tok.decode([i]) for i in encode(tok, MULTIBYTE))


def test_delta_held_until_character_complete(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = encode(tok, "🦜")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add_tokens([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦜"]


def test_incomplete_character_flushed_at_finish_as_decode_does(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = encode(tok, "ok 🦜")[:-1]  # generation stopped inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([i]) for i in ids]
    assert REPLACEMENT not in "".join(deltas)
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert detok.text.endswith(REPLACEMENT)
    assert detok.finish() == "" and detok.add_tokens(encode(tok, "x")) == ""


def test_prompt_ending_inside_a_character(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = encode(tok, "say 字🦜 ok")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPLACEMENT))
    detok, deltas = stream(tok, ids[cut:], prompt=ids[:cut])
    assert "".join(deltas) == detok.text == tok.decode(ids[cut:])


def test_prompt_context_keeps_leading_space_of_sentencepiece_tokens():
    # Metaspace decoders drop the space of a text's first word; the prompt's tail gives the
    # first output token its context, as in vLLM.
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(WordLevel({"▁hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    assert tok.decode([1]) == "world"
    assert stream(tok, [1, 0], prompt=[0])[1] == [" world", " hello", ""]
    assert stream(tok, [1, 0], prompt=[])[1] == ["world", " hello", ""]


class RecordingTokenizer:
    """Delegates to a tokenizer, noting how many ids each decode() call gets."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_decode_windows_stay_short(embedded_tokenizer):
    # Each step decodes a few ids, not the whole output: O(1) work per token.
    tok = RecordingTokenizer(embedded_tokenizer)
    ids = encode(embedded_tokenizer, MULTIBYTE * 4)
    assert len(ids) > 150
    detok, deltas = stream(tok, ids, prompt=list(range(100, 140)))
    assert "".join(deltas) == embedded_tokenizer.decode(ids)
    assert max(tok.lengths) <= 10


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(embedded_tokenizer, skip):
    tok = embedded_tokenizer
    ids = encode(tok, "Hi") + [IM_END, IM_START] + encode(tok, "assistant\n日本") + [IM_END]
    detok, deltas = stream(tok, ids, skip_special_tokens=skip)
    assert_consistent(detok, deltas)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip


def token_texts(tok, ids):
    return [tok.decode([i]) for i in ids]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(embedded_tokenizer, include):
    tok = embedded_tokenizer
    text = "Answer: forty-two. END OF ANSWER and then more text"
    stop = "END OF"
    ids = encode(tok, text)
    assert not any(stop in t for t in token_texts(tok, ids))  # no single token holds it
    detok = IncrementalDetokenizer(tok, [], stop=["never", stop], include_stop_str_in_output=include)
    deltas, streamed = [], ""
    for i in ids:
        deltas.append(detok.add_tokens([i]))
        streamed += deltas[-1]
        if not include:
            assert "END" not in streamed  # the start of the stop string is held back
    deltas.append(detok.finish())
    want = "Answer: forty-two. END OF" if include else "Answer: forty-two. "
    assert detok.stop_matched == stop
    assert detok.text == want == "".join(deltas)
    # The engine may feed a token or two more before it notices: nothing changes.
    assert detok.add_tokens(encode(tok, " END")) == "" and detok.text == want


def test_earliest_stop_string_wins(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = encode(tok, "abc xyz")
    detok, deltas = stream(tok, ids, chunk=len(ids), stop=["xyz", "c x", "zz"])
    assert detok.stop_matched == "c x" and detok.text == "ab" == "".join(deltas)


def test_held_back_prefix_released_when_not_a_stop(embedded_tokenizer):
    tok = embedded_tokenizer
    text = "one STO two STOP three"
    ids = encode(tok, text)
    assert len(ids) == 7  # one| ST|O| two| ST|OP| three
    detok = IncrementalDetokenizer(tok, [], stop=["STOPPED"])
    streamed, seen = "", []
    for i in ids:
        streamed += detok.add_tokens([i])
        seen.append(streamed)
    assert seen == ["one", "one ", "one ", "one STO two", "one STO two ", "one STO two ", text]
    assert detok.finish() == "" and detok.stop_matched is None and detok.text == text


def test_stop_strings_ignored_below_min_tokens(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = encode(tok, "stop now, then stop again")
    n_first = next(i for i in range(len(ids)) if "stop" in tok.decode(ids[:i + 1]))
    detok, deltas = stream(tok, ids, stop=["stop"], min_tokens=n_first + 1)
    assert detok.text == "stop now, then " == "".join(deltas)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(st.characters(exclude_categories=["Cs"], exclude_characters=[REPLACEMENT]), max_size=40),
    chunk=st.integers(1, 4),
    data=st.data(),
)
def test_random_text_roundtrip(embedded_tokenizer, text, chunk, data):
    tok = embedded_tokenizer
    ids = encode(tok, text)
    full = tok.decode(ids)
    detok, deltas = stream(tok, ids, chunk=chunk)
    assert_consistent(detok, deltas)
    assert detok.text == full
    if full == text:  # the tokenizer covers every character: no delta may hold a broken one
        assert not any(REPLACEMENT in d for d in deltas)

    # A stop string taken from the text (or not in it): output is the decode cut at its first match.
    assume(full)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start:start + data.draw(st.integers(1, 6))]
    include = data.draw(st.booleans())
    detok, deltas = stream(tok, ids, chunk=chunk, stop=[stop, "\x00never"], include_stop_str_in_output=include)
    assert_consistent(detok, deltas)
    i = full.find(stop)
    assert detok.stop_matched == stop
    assert detok.text == full[:i + len(stop) if include else i]
