"""Size limits a request meets: before any tokenization, a prompt's length in characters and the
request body's length in bytes; once the prompts are tokenized, the work the request asks for.

Tokenizing a huge prompt only to refuse it for the context costs seconds; counting its characters
costs nothing. The character bound comes from the tokenizer, once at startup: if no token stands
for more than C characters, a text of more than max_model_len * C characters needs more than
max_model_len tokens, so it cannot fit the context whatever else the request says. Characters the
tokenizer drops without a token (a byte-level BPE without an unknown token drops the bytes missing
from its vocabulary: six ASCII control characters for SmolLM2) are not counted. That holds only for
tokenizers that never drop or merge other text before their vocabulary sees it (a normalizer that
strips accents, a pre-tokenizer that removes whitespace, an unknown token that swallows a whole
word); for any other shape `token_bound` says None and the bound is off.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
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
# The most tokens (and logprob entries) one request may make the server produce and return
# (`request_work`). A small body can ask for a huge answer: 8 prompts of 1,000 tokens with n 128,
# echo and 20 logprobs is 22 million entries, a 567 MB response. 4 Mi entries admit n up to 256
# with 16k tokens each, or a full 128k context with 31 logprobs; about 75 MB of JSON at most (some
# 18 bytes an entry).
DEFAULT_MAX_REQUEST_TOKENS = 1 << 22

# Steps that never make the text shorter, so each character still reaches the vocabulary.
_SAFE_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


@dataclass(frozen=True)
class TokenBound:
    """What one token can stand for: at most `max_chars` characters, except `dropped` characters,
    which the tokenizer leaves out without a token."""

    max_chars: int
    dropped: str = ""


@dataclass(frozen=True)
class PromptBound:
    """A text with more than `max_chars` counted characters cannot fit the context."""

    max_chars: int
    dropped: str = ""  # not counted: they may make no token

    def counted(self, text: str) -> int:
        """The characters of `text` that count. Scans the text once per dropped character: for a long
        text, call it off the event loop."""
        return len(text) - sum(text.count(c) for c in self.dropped)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The most characters of text one token can stand for, or None when no such bound holds for
    this tokenizer (or it cannot be checked)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (pure Python) tokenizer: its pipeline cannot be inspected
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 -- any failure means: no bound
        logger.warning("cannot inspect the tokenizer; prompts are not checked for length before tokenization")
        return None
    byte_level = any(step.get("type") == "ByteLevel" for step in _steps(spec.get("pre_tokenizer"), "pretokenizers"))
    problem = (_normalizer_problem(spec.get("normalizer")) or _pre_tokenizer_problem(spec.get("pre_tokenizer"))
               or _added_tokens_problem(spec.get("added_tokens")))
    dropped = ""
    if not problem:
        problem, dropped = _model_problem(spec.get("model") or {}, vocab, byte_level)
    if problem:
        logger.warning("prompts are not checked for length before tokenization: the tokenizer's %s", problem)
        return None
    # Every token's text is a vocabulary entry: for byte-level BPE one character per byte, which is
    # at least the characters the bytes decode to; a byte-fallback entry such as "<0x0A>" stands for
    # one byte; an added (special) token matches its own text. Added tokens are in get_vocab(). A
    # character that keeps one of its bytes is in some token, which holds at most max_chars of them.
    return TokenBound(max(len(token) for token in vocab), dropped)


def prompt_bound(tokenizer: Any, max_model_len: int) -> PromptBound | None:
    """Above this many counted characters no prompt can fit max_model_len tokens (None: no bound).

    A prompt that fits has at most max_model_len tokens, each standing for at most C counted
    characters, so at most max_model_len * C of them; the margin multiplies that."""
    bound = token_bound(tokenizer)
    if bound is None:
        return None
    return PromptBound(max_model_len * bound.max_chars * PROMPT_CHARS_MARGIN, bound.dropped)


@dataclass(frozen=True)
class RequestWork:
    """What one request asks the server to produce and return: for each of its prompts, n choices,
    each of max_tokens generated tokens (plus the prompt's own when it is echoed), each token with
    1 + logprobs entries; plus, with prompt_logprobs, 1 + prompt_logprobs entries per prompt token
    in each choice."""

    prompt_lens: tuple[int, ...]
    n: int
    max_tokens: int
    logprobs: int = 0
    echo: bool = False
    prompt_logprobs: int | None = None

    @property
    def entries(self) -> int:
        per_choice = sum((self.max_tokens + (p if self.echo else 0)) * (1 + self.logprobs)
                         + (p * (1 + self.prompt_logprobs) if self.prompt_logprobs is not None else 0)
                         for p in self.prompt_lens)
        return self.n * per_choice

    def over(self, budget: int) -> tuple[str, str] | None:
        """(The client's 400 message, the field to name) when the work is over `budget`, else None."""
        entries = self.entries
        if entries <= budget:
            return None
        prompts = f"{len(self.prompt_lens)} prompts x " if len(self.prompt_lens) > 1 else ""
        tokens = f"max_tokens {self.max_tokens}" + (" + the echoed prompt" if self.echo else "")
        parts = f"{prompts}n {self.n} x ({tokens}) x (1 + logprobs {self.logprobs})"
        if self.prompt_logprobs is not None:
            parts += f" + the prompt x (1 + prompt_logprobs {self.prompt_logprobs})"
        # Name the factor that most inflates the work (one the client chose above its least).
        factors = {"n": self.n, "logprobs": 1 + self.logprobs, "prompt": len(self.prompt_lens),
                   "prompt_logprobs": 1 + (self.prompt_logprobs or 0), "max_tokens": 1}
        param = max(factors, key=factors.get) if max(factors.values()) > 1 else "max_tokens"
        return (f"This request asks for up to {entries} tokens and logprob entries ({parts}), over this server's "
                f"limit of {budget} per request. Lower n, max_tokens or logprobs, drop echo, or split the "
                "request.", param)


def default_max_body_bytes(prompt_chars: int | None) -> int:
    """A body limit that admits every prompt of up to `prompt_chars` characters in its costliest JSON
    spelling, with room for the other fields."""
    if prompt_chars is None:
        return DEFAULT_MAX_BODY_BYTES
    return prompt_chars * MAX_JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES


def byte_level_symbols() -> list[str]:
    """The character that stands for each byte (0-255) in a byte-level BPE vocabulary (GPT-2's
    scheme): printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, n = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + n))
            n += 1
    return symbols


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


def _model_problem(model: dict, vocab: dict[str, int], byte_level: bool) -> tuple[str | None, str]:
    """(What breaks the bound, or None; the characters the model drops without a token)."""
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return f"{kind} model maps a whole unknown word to one token", ""
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return None, ""  # an unknown character becomes its bytes' tokens, never one unknown token
    if kind == "Unigram":
        return "Unigram model fuses a run of unknown characters into one token", ""
    if model.get("unk_token") is not None:
        if model.get("fuse_unk"):
            return "BPE model fuses a run of unknown characters into one token", ""
        return None, ""  # one unknown token per unknown character
    # No unknown token: a symbol missing from the vocabulary is dropped. Byte-level symbols are
    # bytes, so a character vanishes only if every one of its UTF-8 bytes is missing.
    if not byte_level or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "BPE model drops any character missing from its vocabulary", ""
    missing = [b for b, symbol in enumerate(byte_level_symbols()) if symbol not in vocab]
    if any(0x80 <= b < 0xC0 for b in missing):
        return "BPE model can drop whole multi-byte characters (continuation bytes are missing)", ""
    return None, "".join(chr(b) for b in missing if b < 0x80)


def _added_tokens_problem(added: list[dict] | None) -> str | None:
    for token in added or []:
        if token.get("lstrip") or token.get("rstrip"):
            return f"added token {token.get('content')!r} absorbs the whitespace beside it"
    return None
