"""Checks on text that users hand to the engine."""

from __future__ import annotations


def check_unicode(text: str, what: str) -> str:
    """`text` itself if it is valid Unicode, as a tokenizer needs; else a ValueError saying that
    `what` is not and where. A Python str, like JSON's "\\ud800" escape, can hold a lone surrogate
    (half of a UTF-16 pair), which no UTF encoding accepts."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # the only characters UTF-8 refuses are surrogates
        raise ValueError(f"{what} is not valid Unicode: it holds a lone surrogate {text[e.start]!r} "
                         f"at position {e.start}") from None
    return text
