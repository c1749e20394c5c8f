"""What a request asks its output to follow: a JSON schema, a regex, a choice, a grammar, a structural tag."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

from pagedserve.errors import ParameterError
from pagedserve.structured_output.grammar_check import parse_schema


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names). Exactly one of:
    `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object), `regex`,
    `choice` (one of these strings), `grammar` (xgrammar's EBNF, GBNF-like, root rule `root`) or
    `structural_tag` (xgrammar's structural tag, as a dict or its JSON text: e.g. free text in which
    each tool call, once its trigger is written, follows its schema; vLLM's older form
    `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` is taken too).
    `disable_any_whitespace`: JSON without optional whitespace between tokens.

    Compiled with xgrammar by the engine core (`structured_output/manager.py`); a spec beyond the
    limits of `structured_output/grammar_check.py`, or one xgrammar cannot parse, is a ParameterError at
    `verify_for_engine`. JSON text is parsed once, here: `json` holds the schema as a dict after."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def fail(rule: str) -> None:
            raise ParameterError("structured_outputs", f"structured_outputs: {rule}")

        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            fail(f"give exactly one of json, json_object, regex, choice, grammar or structural_tag, "
                 f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            fail("json must be a JSON schema, as an object or its JSON text")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            fail("structural_tag must be a structural tag, as an object or its JSON text")
        if isinstance(self.structural_tag, str):
            try:
                jsonlib.loads(self.structural_tag)
            except ValueError as e:
                fail(f"structural_tag is not valid JSON text: {e}")
        if isinstance(self.json, str):
            self.json = parse_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                fail(f"{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                fail("choice must be a non-empty list of non-empty strings")
        if not isinstance(self.disable_any_whitespace, bool):
            fail("disable_any_whitespace must be a bool")

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: (kind, spec text, whitespace flag). Requests with
        equal keys share one compiled grammar."""
        if self.json is not None:
            return "json", jsonlib.dumps(self.json), self.disable_any_whitespace  # key order is property order
        if self.json_object:
            return "json_object", "", self.disable_any_whitespace
        if self.choice is not None:
            return "choice", jsonlib.dumps(self.choice), False
        if self.regex is not None:
            return "regex", self.regex, False
        if self.structural_tag is not None:
            tag = self.structural_tag
            return "structural_tag", tag if isinstance(tag, str) else jsonlib.dumps(tag), False
        return "grammar", self.grammar, False


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name
