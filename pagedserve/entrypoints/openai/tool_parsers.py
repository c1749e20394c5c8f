"""Tool calls out of a choice's output text, and the call format the model is asked to write.

The output side of tool calling. A `CallStream` follows one choice's growing text and turns it into
events: text that is content (`Text`), the start of a tool call (`CallStart`, with the function's
name), and fragments of its arguments (`CallArguments`, JSON text). The streaming response sends
the events as deltas; the non-streaming one runs the same stream over the finished text
(`collect`), so both always report the same calls.

- `--tool-call-parser` picks a `ToolParser` for `tool_choice: "auto"`, with vLLM's names:
  `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text around them is
  content) and `llama3_json` (the whole output, after an optional `<|python_tag|>`, is
  `{"name": ..., "parameters": {...}}` objects separated by ";"). Output that does not parse as
  calls is content: a malformed call never becomes a half call.
- `tool_choice: "required"` and a named function constrain the output with a JSON schema (see
  ChatCompletionRequest.tool_schema): `RequiredCallsStream` and `NamedCallStream` read that JSON.

A parser also writes calls in its own format (`format_calls`), and describes the tools and that
format (`instructions`), for chat templates that know nothing of tools (entrypoints/openai/tool_prompt.py).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

# ---- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place in the choice's tool_calls
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # a fragment of the arguments' JSON text


Event = Text | CallStart | CallArguments


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


def collect(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """The content (None when there is none) and the calls that `events` add up to."""
    text, calls = [], []
    for event in events:
        if isinstance(event, Text):
            text.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ToolCall(event.name, ""))
        else:
            calls[event.index].arguments += event.text
    return "".join(text) or None, calls


_decoder = json.JSONDecoder()


def _dump(arguments: dict[str, Any]) -> str:
    # A lone surrogate the model wrote as an escape ("\\ud800") stays one: UTF-8 cannot carry it.
    return escape_lone_surrogates(json.dumps(arguments, ensure_ascii=False))


def escape_lone_surrogates(json_text: str) -> str:
    """JSON text whose strings may hold lone surrogates (a JSON escape such as "\\ud800" that the
    model wrote and a parser decoded), which UTF-8 cannot encode: each written as its JSON escape,
    so the text is valid JSON, UTF-8 encodable, and means what it meant. In a str, a surrogate is
    always lone (json.loads joins the halves of a pair into one character)."""
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", json_text)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _call_object(obj: Any, *argument_keys: str) -> ToolCall | None:
    """A call from a parsed JSON object: a string "name" and an object under one of argument_keys
    (an absent one means no arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    given = [key for key in argument_keys if key in obj]
    if len(given) > 1 or set(obj) - {"name", *argument_keys}:
        return None
    arguments = obj[given[0]] if given else {}
    if not isinstance(arguments, dict):
        return None
    # A name is plain text, not JSON: a lone surrogate in it shows as its escape's characters.
    name = obj["name"].encode("utf-8", "backslashreplace").decode()
    return ToolCall(name, _dump(arguments))


# ---- streams -----------------------------------------------------------------------------------


class CallStream(ABC):
    """Follows one choice's output. `feed` takes the whole text so far (it only grows) and returns
    the events it adds; `final=True` on the last call, which flushes what was held back."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str, final: bool) -> list[Event]: ...

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def _call(self, call: ToolCall) -> list[Event]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        # The name opens the call with empty arguments (OpenAI's first delta of a call), then the arguments.
        return [CallStart(index, call.name), CallArguments(index, call.arguments)]


class PlainStream(CallStream):
    """No tool calls: every character is content."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def feed(self, text: str, final: bool) -> list[Event]:
        new, self.sent = text[self.sent:], len(text)
        return [Text(new)] if new else []


class HermesStream(CallStream):
    """`<tool_call>{json}</tool_call>` blocks. Text is held back while it may be the start of a
    block; the whitespace that separates text from a block is dropped. A block whose JSON is not a
    call, or that never closes, is content as written."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0  # text before it has become events
        self.space = ""  # whitespace held back: it goes out only if more text follows it
        self.after_call = False

    def feed(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            start = text.find(self.OPEN, self.pos)
            if start < 0:
                end = len(text) if final else len(text) - _partial_suffix(text, self.pos, self.OPEN)
                events += self._text(text[self.pos:end])
                self.pos = end
                break
            close = text.find(self.CLOSE, start + len(self.OPEN))
            if close < 0 and not final:
                events += self._text(text[self.pos:start])
                self.pos = start  # hold the open block until it closes
                break
            if close < 0:
                events += self._text(text[self.pos:])
                self.pos = len(text)
                break
            end = close + len(self.CLOSE)
            call = self._parse(text[start + len(self.OPEN):close])
            if call is None:
                events += self._text(text[self.pos:end])
            else:
                events += self._text(text[self.pos:start])
                self.space, self.after_call = "", True
                events += self._call(call)
            self.pos = end
        if final and self.space and not self.num_calls:
            events.append(Text(self.space))
        return events

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return _call_object(obj, "arguments", "parameters")

    def _text(self, text: str) -> list[Event]:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        body = text.rstrip()
        if not body:
            self.space += text
            return []
        out, self.space = self.space + body, text[len(body):]
        return [Text(out)]


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """The length of the longest end of text[start:] that begins `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Llama3JsonStream(CallStream):
    """The whole output is calls, `{"name": ..., "parameters": {...}}` (or "arguments"), several
    separated by ";", optionally after `<|python_tag|>`; or else it is all content. Output that may
    be calls is held back until it ends; any other streams as content at once."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.plain: PlainStream | None = None  # once the output cannot be calls

    def feed(self, text: str, final: bool) -> list[Event]:
        if self.plain is None:
            head = text.lstrip()
            maybe_calls = head.startswith(("{", self.TAG)) or self.TAG.startswith(head)
            if maybe_calls and not final:
                return []
            calls = self._parse(head) if maybe_calls else None
            if calls:
                return [event for call in calls for event in self._call(call)]
            self.plain = PlainStream()
        return self.plain.feed(text, final)

    def _parse(self, text: str) -> list[ToolCall] | None:
        text = text.removeprefix(self.TAG)
        calls, i = [], _skip_space(text, 0)
        while True:
            try:
                obj, i = _decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _call_object(obj, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            i = _skip_space(text, i)
            if i == len(text):
                return calls
            if text[i] != ";":
                return None
            i = _skip_space(text, i + 1)


class NamedCallStream(CallStream):
    """A named tool_choice: the output is the arguments of one call to `name` (the constraint's
    JSON object), streamed as it comes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.sent = 0

    def feed(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        if not self.num_calls:
            self.num_calls = 1
            events.append(CallStart(0, self.name))
        new, self.sent = text[self.sent:], len(text)
        if new:
            events.append(CallArguments(0, new))
        return events

    def finish_reason(self, reason: str | None) -> str | None:
        return reason  # OpenAI answers a forced function with "stop", not "tool_calls"


class RequiredCallsStream(CallStream):
    """tool_choice "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`
    (the constraint's); each call goes out as soon as its object is complete. If no call completes
    (the output was cut short), the text is content."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.opened = False

    def feed(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        i = _skip_space(text, self.pos)
        if not self.opened and text[i:i + 1] == "[":
            self.opened, i = True, i + 1
            self.pos = i
        while self.opened:
            i = _skip_space(text, i)
            if text[i:i + 1] == ",":
                i = _skip_space(text, i + 1)
            try:
                obj, end = _decoder.raw_decode(text, i)
            except ValueError:
                break  # not complete yet (or the end of the array)
            call = _call_object(obj, "parameters")
            if call is None:
                break
            events += self._call(call)
            i = self.pos = end
        if final and not self.num_calls and text:
            events.append(Text(text))
        return events


class FirstCallOnly(CallStream):
    """parallel_tool_calls false with tool_choice "auto": the first call; later ones are dropped."""

    def __init__(self, inner: CallStream) -> None:
        super().__init__()
        self.inner = inner

    def feed(self, text: str, final: bool) -> list[Event]:
        events = [e for e in self.inner.feed(text, final) if isinstance(e, Text) or e.index == 0]
        self.num_calls = min(self.inner.num_calls, 1)
        return events


# ---- parsers -----------------------------------------------------------------------------------


class ToolParser(ABC):
    """A model family's tool-call format: read from the output, written into history, described
    to models whose chat template does not render tools."""

    name: str

    @abstractmethod
    def stream(self) -> CallStream: ...

    @abstractmethod
    def format_calls(self, calls: list[ToolCall]) -> str:
        """Calls as the model would have written them (for an assistant message in the history)."""

    @abstractmethod
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt block listing `tools` (OpenAI's tool objects) and how to call them."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the calls of a finished output."""
        return collect(self.stream().feed(text, final=True))

    def structural_tag(self, arguments: dict[str, dict[str, Any]], single_call: bool) -> dict[str, Any] | None:
        """An xgrammar structural tag for tool_choice "auto" with strict tools: free text, in which
        a call, once its opening is written, names one of `arguments`' functions and has arguments
        that follow the schema given for it; `single_call`: the output ends after the first call.
        None when this format has no such tag (strict tools are then refused)."""
        return None


def _tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


def _arguments(call: ToolCall) -> Any:
    return json.loads(call.arguments) if call.arguments else {}


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> CallStream:
        return HermesStream()

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'<tool_call>\n{json.dumps({"name": c.name, "arguments": _arguments(c)}, ensure_ascii=False)}'
                         "\n</tool_call>" for c in calls)

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou can call the functions below. Each is described by a JSON object, between "
                f"<tools> and </tools>:\n<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
                "To call a function, write its name and its arguments as a JSON object between <tool_call> "
                "and </tool_call>, one block per call:\n<tool_call>\n"
                '{"name": "<function name>", "arguments": {"<argument>": <value>}}\n</tool_call>')

    def structural_tag(self, arguments: dict[str, dict[str, Any]], single_call: bool) -> dict[str, Any] | None:
        # Each call as format_calls writes it, so the trigger's tags are the whole of the block.
        tags = [{"type": "tag", "begin": f'{HermesStream.OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": TAG_MAX_WHITESPACE},
                 "end": f"}}\n{HermesStream.CLOSE}"}
                for name, schema in arguments.items()]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [HermesStream.OPEN],
                                                     "tags": tags, "stop_after_first": single_call}}


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> CallStream:
        return Llama3JsonStream()

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": _arguments(c)}, ensure_ascii=False) for c in calls)

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou can call the functions below, each described by a JSON object:\n"
                f"{_tool_lines(tools)}\n\n"
                "To call a function, answer with only a JSON object of this form, and nothing else:\n"
                '{"name": "<function name>", "parameters": {"<argument>": <value>}}\n'
                'Separate several calls with "; ". If no function helps, answer in plain text.')


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}

# Whitespace allowed between two JSON tokens of constrained arguments (as JSON_MAX_WHITESPACE in
# structured_output/manager.py: unbounded, a small model can write newlines until max_tokens).
TAG_MAX_WHITESPACE = 1

# `--tool-call-parser auto`: the parser whose call syntax the chat template writes, by a marker only
# that syntax has (the first that the template's source contains wins).
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))


def parser_for_template(template: str | dict[str, str] | None) -> str:
    """The tool-call parser's name for a chat template (its source), for `--tool-call-parser auto`.
    ValueError when the template writes no call syntax a parser knows."""
    sources = list(template.values()) if isinstance(template, dict) else [template or ""]
    for marker, name in TEMPLATE_MARKERS:
        if any(marker in source for source in sources):
            return name
    raise ValueError("--tool-call-parser auto: the chat template writes no tool-call syntax that a parser knows "
                     f"({', '.join(f'{m} for {n}' for m, n in TEMPLATE_MARKERS)}); name the parser: "
                     f"{', '.join(TOOL_PARSERS)}")


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}") from None
