"""Size limits a request meets before any tokenization: a prompt's length in characters, and the
request body's length in bytes.

Tokenizing a huge prompt only to refuse it for the context costs seconds; counting its characters
costs nothing. The character bound comes from the tokenizer, once at startup: if no token stands
for more than C characters, a text of more than max_model_len * C characters needs more than
max_model_len tokens, so it cannot fit the context whatever else the request says. That holds only
for tokenizers that never drop or merge text before their vocabulary sees it (a normalizer that
strips accents, a pre-tokenizer that removes whitespace, an unknown-token that swallows a whole
word); for any other shape `max_chars_per_token` says None and the bound is off.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

# A checked bound is exact; the margin is insurance against a tokenizer shape misjudged below. It
# only decides which absurd prompts are tokenized (in a thread) before their refusal.
PROMPT_CHARS_MARGIN = 2
# The most bytes one character of a prompt can take in a JSON body: a character outside the Basic
# Multilingual Plane written as two escaped UTF-16 halves, "\\ud83d\\ude00".
MAX_JSON_BYTES_PER_CHAR = 12
BODY_OVERHEAD_BYTES = 1 << 20  # every other field of the request
DEFAULT_MAX_BODY_BYTES = 64 << 20  # when there is no character bound to derive the limit from

# Steps that never make the text shorter, so each character still reaches the vocabulary.
_SAFE_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when no such bound holds for
    this tokenizer (or it cannot be checked): then no prompt is refused by its length in characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (pure Python) tokenizer: its pipeline cannot be inspected
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 -- any failure means: no bound
        logger.warning("cannot inspect the tokenizer; prompts are not checked for length before tokenization")
        return None
    problem = (_normalizer_problem(spec.get("normalizer")) or _pre_tokenizer_problem(spec.get("pre_tokenizer"))
               or _model_problem(spec.get("model") or {}, vocab) or _added_tokens_problem(spec.get("added_tokens")))
    if problem:
        logger.warning("prompts are not checked for length before tokenization: the tokenizer's %s", problem)
        return None
    # Every token's text is a vocabulary entry: for byte-level BPE one character per byte, which is
    # at least the characters the bytes decode to; a byte-fallback entry such as "<0x0A>" stands for
    # one byte; an added (special) token matches its own text. Added tokens are in get_vocab().
    return max(len(token) for token in vocab)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """The character count above which no prompt can fit max_model_len tokens (None: no bound).

    A prompt that fits has at most max_model_len tokens, each standing for at most C characters, so
    at most max_model_len * C characters; the margin multiplies that."""
    per_token = max_chars_per_token(tokenizer)
    return None if per_token is None else max_model_len * per_token * PROMPT_CHARS_MARGIN


def default_max_body_bytes(prompt_chars: int | None) -> int:
    """A body limit that admits the longest prompt the character bound admits, in the costliest JSON
    spelling, with room for the other fields."""
    if prompt_chars is None:
        return DEFAULT_MAX_BODY_BYTES
    return prompt_chars * MAX_JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES


def _steps(spec: dict | None, sequence_key: str) -> list[dict]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get(sequence_key) or [] for step in _steps(inner, sequence_key)]
    return [spec]


def _normalizer_problem(spec: dict | None) -> str | None:
    for step in _steps(spec, "normalizers"):
        kind = step.get("type")
        if kind == "Replace":
            pattern, content = step.get("pattern") or {}, step.get("content") or ""
            if "String" in pattern and len(pattern["String"]) <= len(content):
                continue  # e.g. " " -> "\u2581": never shorter
            return f"normalizer replaces {pattern} with {content!r}, which can shorten the text"
        if kind not in _SAFE_NORMALIZERS:
            return f"normalizer {kind} can shorten the text"
    return None


def _pre_tokenizer_problem(spec: dict | None) -> str | None:
    for step in _steps(spec, "pretokenizers"):
        kind = step.get("type")
        if kind in ("Split", "Punctuation") and step.get("behavior") != "Removed":
            continue  # splits keep every character unless the behaviour removes the matches
        if kind not in _SAFE_PRE_TOKENIZERS:
            return f"pre-tokenizer {kind} can drop characters"
    return None


def _model_problem(model: dict, vocab: dict[str, int]) -> str | None:
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return f"{kind} model maps a whole unknown word to one token"
    all_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    if model.get("byte_fallback") and all_bytes:
        return None  # an unknown character becomes its bytes' tokens, never one unknown token
    if kind == "Unigram" and model.get("unk_id") is not None:
        return "Unigram model fuses a run of unknown characters into one token"
    if kind == "BPE" and model.get("unk_token") is not None and model.get("fuse_unk"):
        return "BPE model fuses a run of unknown characters into one token"
    return None


def _added_tokens_problem(added: list[dict] | None) -> str | None:
    for token in added or []:
        if token.get("lstrip") or token.get("rstrip"):
            return f"added token {token.get('content')!r} absorbs the whitespace beside it"
    return None
