"""Bounds and refusals a structured-output spec meets before xgrammar sees it.

xgrammar's parsers recurse without a bound of their own: a JSON schema whose `pattern` nests
30,000 groups kills the process (SIGSEGV), a regex or an EBNF grammar nesting more than 1,000
is an error, and object or array nesting costs seconds from a few hundred levels (300 objects:
5.8 s to parse). It also ignores some JSON-schema keywords, so that the output would not follow
the schema the client gave. These checks are pure Python, iterative where input decides the
depth, and linear in the spec's size: they run in the front (on its executor) and again in the
core, each time before xgrammar parses anything.

Limits (far above what real schemas use, far below what crashes or stalls xgrammar):
- MAX_SPEC_CHARS: the spec's text (a schema's JSON, a regex, a grammar, the choices' JSON).
- MAX_JSON_DEPTH: nesting of a schema's JSON (each object or array is a level).
- MAX_REGEX_NESTING: nesting of groups and character classes in a regex or a schema's pattern,
  and of parentheses in an EBNF grammar.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pagedserve.errors import ParameterError

MAX_SPEC_CHARS = 256 * 1024
MAX_JSON_DEPTH = 100
MAX_REGEX_NESTING = 100

# Keywords xgrammar 0.2.9 accepts and does not enforce (checked with its own matcher).
UNENFORCED_KEYWORDS = ("not", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                       "dependencies", "if", "then", "else", "$dynamicRef", "$recursiveRef", "contentEncoding",
                       "contentMediaType", "contentSchema")
# String formats xgrammar enforces; it ignores the others (idn-email, iri, byte, password, ...).
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference",
                              "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"})

# Where a schema holds schemas: one, a list of them, or a map of names to them.
_ONE_SCHEMA = ("additionalProperties", "additionalItems", "items", "propertyNames", "unevaluatedItems",
               "unevaluatedProperties", "not", "contains", "if", "then", "else", "contentSchema")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _fail(rule: str) -> None:
    raise ParameterError("structured_outputs", f"structured_outputs: {rule}")


def check_size(text: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        _fail(f"the {what} is {len(text)} characters long, more than the limit of {MAX_SPEC_CHARS}")


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is refused anyway: no need to walk it
            stack.extend((child, depth + 1) for child in children)
    return deepest


def regex_nesting(regex: str) -> int:
    """How deeply groups and character classes nest in a regex (a class holds no group)."""
    deepest = depth = 0
    in_class = escaped = False
    for c in regex:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif in_class:
            if c == "]":
                in_class, depth = False, depth - 1
        elif c == "[":
            in_class, depth = True, depth + 1
            deepest = max(deepest, depth)
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
    return deepest


def ebnf_nesting(grammar: str) -> int:
    """How deeply parentheses nest in an EBNF grammar, outside its strings and character classes."""
    deepest = depth = 0
    quote: str | None = None  # '"' inside a string, "]" inside a character class
    escaped = False
    for c in grammar:
        if quote is not None:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
        elif c == '"':
            quote = '"'
        elif c == "[":
            quote = "]"
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
    return deepest


def check_regex(regex: str, what: str) -> None:
    check_size(regex, what)
    if regex_nesting(regex) > MAX_REGEX_NESTING:
        _fail(f"the {what} nests groups or character classes more than {MAX_REGEX_NESTING} deep")


def check_ebnf(grammar: str) -> None:
    check_size(grammar, "grammar")
    if ebnf_nesting(grammar) > MAX_REGEX_NESTING:
        _fail(f"the grammar nests parentheses more than {MAX_REGEX_NESTING} deep")


def parse_schema(schema: str | dict[str, Any]) -> dict[str, Any]:
    """The schema as a dict, once its size and depth are within the limits and it uses nothing
    xgrammar would leave unenforced. Its text is parsed here only when it comes as text."""
    given_as_text = isinstance(schema, str)
    if given_as_text:
        check_size(schema, "JSON schema")
        try:
            schema = json.loads(schema)
        except RecursionError:
            _fail(f"the JSON schema nests deeper than {MAX_JSON_DEPTH} levels")
        except ValueError as e:
            _fail(f"json is not valid JSON text: {e}")
    if isinstance(schema, bool):  # true: anything; false: nothing
        if not schema:
            _fail("the JSON schema is false: no output satisfies it")
        return {}
    if not isinstance(schema, dict):
        _fail("the JSON schema must be an object")
    if json_depth(schema) > MAX_JSON_DEPTH:
        _fail(f"the JSON schema nests deeper than {MAX_JSON_DEPTH} levels")
    if not given_as_text:
        check_size(json.dumps(schema), "JSON schema")
    for_each_schema(schema, _check_keywords)
    return schema


def for_each_schema(schema: Any, visit: Callable[[dict[str, Any], str], None], path: str = "#") -> None:
    """visit(subschema, its JSON pointer) for `schema` and every schema inside it, walking only
    where schemas are (a property named "not" is a name, an enum's values are values). Recursive:
    call it on a schema whose depth is bounded."""
    if not isinstance(schema, dict):
        return
    visit(schema, path)
    for key in _ONE_SCHEMA:
        if isinstance(schema.get(key), dict):
            for_each_schema(schema[key], visit, f"{path}/{_escape(key)}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, item in enumerate(schema[key]):
                for_each_schema(item, visit, f"{path}/{_escape(key)}/{i}")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, item in schema[key].items():
                for_each_schema(item, visit, f"{path}/{_escape(key)}/{_escape(name)}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _check_keywords(schema: dict[str, Any], path: str) -> None:
    def refuse(what: str) -> None:
        _fail(f"the JSON schema uses {what} at {path}, which this server cannot enforce")

    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            refuse(f'"{keyword}"')
    if schema.get("uniqueItems") is True:
        refuse('"uniqueItems"')
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        refuse('"allOf" of more than one schema')
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS and schema.get("type", "string") == "string":
        refuse(f'"format": {json.dumps(fmt)}')
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        refuse(f'"$ref": {json.dumps(ref)} (only references within the schema, "#" or "#/...", are resolved)')
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, f"pattern at {path}")


def rebase_refs(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of `schema` to be embedded at `pointer` ("#/$defs/x") of another schema: its local
    references ("#", "#/...") rewritten to point into it there rather than at the new root."""
    copy = json.loads(json.dumps(schema))

    def rebase(sub: dict[str, Any], _: str) -> None:
        ref = sub.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            sub["$ref"] = pointer + ref[1:]

    for_each_schema(copy, rebase)
    return copy
