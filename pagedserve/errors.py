"""Errors every layer may raise: the leaf that the request-checking modules share."""

from __future__ import annotations


class ParameterError(ValueError):
    """A sampling parameter is invalid; `param` names it (the server's error body carries it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
