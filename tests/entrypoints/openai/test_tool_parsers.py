"""The tool-call parsers and streams on their own: what output text becomes calls and what stays
content, malformed output included, and that a stream fed a few characters at a time adds up to
the same answer as the finished text."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.openai.tool_parsers import (
    CallArguments, CallStart, FirstCallOnly, HermesToolParser, Llama3JsonToolParser, NamedCallStream,
    RequiredCallsStream, Text, ToolCall, collect, get_tool_parser, parser_for_template,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def fed_in_pieces(stream, text: str, step: int = 1) -> tuple[list, tuple]:
    """Feed `text` to `stream` `step` characters at a time; (events, what they add up to)."""
    events = []
    for end in [*range(step, len(text), step), len(text)]:
        events += stream.feed(text[:end], final=end == len(text))
    return events, collect(events)


HERMES_CASES = [
    # (output, content, calls as (name, arguments))
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),  # no arguments: an empty object
    (f"<tool_call>{WEATHER}</tool_call>\nDone: 21 degrees.", "Done: 21 degrees.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("Paris is sunny.\n", "Paris is sunny.\n", []),  # plain text keeps its whitespace
    ("x < y and a <tool", "x < y and a <tool", []),  # a tag's beginning that never became one
    # Malformed: content as written, no call.
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    (f"<tool_call>{WEATHER}", f"<tool_call>{WEATHER}", []),  # never closed (cut off by max_tokens)
    # One good call, one malformed: the good one is a call, the other stays text.
    (f"<tool_call>{{oops}}</tool_call><tool_call>{WEATHER}</tool_call>", "<tool_call>{oops}</tool_call>",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_reads_tool_call_blocks_and_leaves_the_rest_as_content(text, content, calls):
    parser = HermesToolParser()
    expected = (content, [ToolCall(name, json.dumps(args)) for name, args in calls])
    assert parser.extract(text) == expected
    for step in (1, 3, 7):  # streamed, cut anywhere: the same content and calls
        assert fed_in_pieces(parser.stream(), text, step)[1] == expected


def test_hermes_streams_text_at_once_but_holds_what_may_start_a_call():
    stream = HermesToolParser().stream()
    assert stream.feed("Sure", False) == [Text("Sure")]
    assert stream.feed("Sure, <tool", False) == [Text(",")]  # " <tool" may open a call (and the space is held)
    assert stream.feed(f"Sure, <tool_call>{WEATHER[:20]}", False) == []
    events = stream.feed(f"Sure, <tool_call>{WEATHER}</tool_call>", True)
    assert events == [CallStart(0, "get_weather"), CallArguments(0, '{"city": "Paris", "unit": "celsius"}')]
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_without_a_call_the_finish_reason_is_the_engines():
    stream = HermesToolParser().stream()
    stream.feed("Hello.", True)
    assert stream.finish_reason("stop") == "stop"


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "f", "arguments": {"s": "a; b"}}; {"name": "g", "parameters": {}}', None,
     [("f", {"s": "a; b"}), ("g", {})]),
    (' \n{"name": "now"}', None, [("now", {})]),
    ("The weather is fine.", "The weather is fine.", []),
    # Malformed: all content.
    ('{"name": "f", "parameters": {"x": 1}} and then text', '{"name": "f", "parameters": {"x": 1}} and then text', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),  # cut off
    ('{"name": "f", "parameters": {}}; oops', '{"name": "f", "parameters": {}}; oops', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_reads_calls_when_the_whole_output_is_calls(text, content, calls):
    parser = Llama3JsonToolParser()
    expected = (content, [ToolCall(name, json.dumps(args)) for name, args in calls])
    assert parser.extract(text) == expected
    for step in (1, 5):
        assert fed_in_pieces(parser.stream(), text, step)[1] == expected


def test_llama3_json_streams_text_that_cannot_be_a_call_at_once():
    stream = Llama3JsonToolParser().stream()
    assert stream.feed("It", False) == [Text("It")]
    held = Llama3JsonToolParser().stream()
    assert held.feed('{"na', False) == [] and held.feed("<|python", False) == []


def test_required_calls_go_out_as_each_object_completes():
    stream = RequiredCallsStream()
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    first_end = text.index("}}") + 2
    assert stream.feed(text[:first_end - 1], False) == []
    assert stream.feed(text[:first_end], False) == [CallStart(0, "f"), CallArguments(0, '{"x": 1}')]
    assert stream.feed(text, True) == [CallStart(1, "g"), CallArguments(1, "{}")]
    assert stream.finish_reason("stop") == "tool_calls"
    assert fed_in_pieces(RequiredCallsStream(), text)[1] == (None, [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")])


def test_required_output_cut_before_any_call_is_content():
    text = '[{"name": "f", "parameters": {"x": '
    assert fed_in_pieces(RequiredCallsStream(), text)[1] == (text, [])
    # Cut after a whole call: that call stands.
    text = '[{"name": "f", "parameters": {}}, {"name": "g", "para'
    assert fed_in_pieces(RequiredCallsStream(), text)[1] == (None, [ToolCall("f", "{}")])


def test_a_named_call_streams_its_arguments_as_they_come_and_finishes_with_stop():
    stream = NamedCallStream("add")
    assert stream.feed('{"a"', False) == [CallStart(0, "add"), CallArguments(0, '{"a"')]
    assert stream.feed('{"a": 1}', True) == [CallArguments(0, ": 1}")]
    assert stream.finish_reason("stop") == "stop"  # OpenAI's answer to a forced function


def test_first_call_only_drops_later_calls():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>" + '{"name": "add", "arguments": {}}</tool_call>'
    stream = FirstCallOnly(HermesToolParser().stream())
    content, calls = fed_in_pieces(stream, text, 4)[1]
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert stream.num_calls == 1 and stream.finish_reason("stop") == "tool_calls"


def test_history_calls_are_written_in_the_format_the_parser_reads():
    calls = [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("add", '{"a": 1}')]
    for parser in (HermesToolParser(), Llama3JsonToolParser()):
        assert parser.extract(parser.format_calls(calls)) == (None, calls)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_instructions_list_every_tool_as_json(name):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "add"}}]
    text = get_tool_parser(name).instructions(tools)
    for tool in tools:
        assert json.dumps(tool) in text


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


# ---- strict tools under tool_choice "auto" -----------------------------------------------------

STRICT_ARGUMENTS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"], "additionalProperties": False},
                    "free": {"type": "object"}}


@pytest.fixture(scope="module")
def tag_grammar(embedded_tokenizer):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(embedded_tokenizer)
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    def accepts(tag: dict, text: str) -> bool:
        return xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag))).accept_string(text)

    return accepts


@pytest.mark.parametrize("text,accepted", [
    ("Any answer in text, <b>tags</b> and {braces} included.", True),
    # What format_calls writes, and so what the instructions show the model.
    (HermesToolParser().format_calls([ToolCall("get_weather", '{"city": "Paris"}')]), True),
    ('It is: <tool_call>\n{"name": "free", "arguments": {"any": [1, 2]}}\n</tool_call> then text', True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 7}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', False),  # not one of the tools
    ("<tool_call>not a call</tool_call>", False),
])
def test_hermes_tag_lets_text_be_and_holds_each_call_to_its_schema(tag_grammar, text, accepted):
    tag = HermesToolParser().structural_tag(STRICT_ARGUMENTS, single_call=False)
    assert tag_grammar(tag, text) is accepted
    if accepted and "<tool_call>" in text:
        assert HermesToolParser().extract(text)[1]  # what the tag allows, the parser reads as a call


def test_hermes_tag_for_a_single_call_ends_after_it(tag_grammar):
    call = HermesToolParser().format_calls([ToolCall("get_weather", '{"city": "Paris"}')])
    single = HermesToolParser().structural_tag(STRICT_ARGUMENTS, single_call=True)
    assert tag_grammar(single, call) and not tag_grammar(single, f"{call}\n{call}")
    assert tag_grammar(HermesToolParser().structural_tag(STRICT_ARGUMENTS, single_call=False), f"{call}\n{call}")


def test_llama3_json_has_no_tag():
    assert Llama3JsonToolParser().structural_tag(STRICT_ARGUMENTS, single_call=False) is None


@pytest.mark.parametrize("template,parser", [
    ("{% for m in messages %}<tool_call>{{ m.content }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}", "llama3_json"),
    ({"default": "{{ messages }}", "tool_use": "{{ tools }}<tool_call>"}, "hermes"),
])
def test_parser_for_template_reads_the_call_syntax_the_template_writes(template, parser):
    assert parser_for_template(template) == parser


def test_parser_for_template_without_a_known_syntax_is_an_error(embedded_tokenizer):
    with pytest.raises(ValueError, match="--tool-call-parser auto: the chat template writes no tool-call syntax"):
        parser_for_template(embedded_tokenizer.chat_template)
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        parser_for_template(None)
# A call whose name and arguments hold JSON escapes of lone surrogates, as a model may write them:
# json.loads makes each a str character that UTF-8 cannot encode.
SURROGATE_ARGS = '{"city": "Par\\ud800is", "note": "\\udfff", "ok": "\\ud83d\\ude00"}'


@pytest.mark.parametrize("stream, text", [
    (HermesToolParser().stream, f'<tool_call>\n{{"name": "get\\ud800", "arguments": {SURROGATE_ARGS}}}\n</tool_call>'),
    (Llama3JsonToolParser().stream, f'{{"name": "get\\ud800", "parameters": {SURROGATE_ARGS}}}'),
    (RequiredCallsStream, f'[{{"name": "get\\ud800", "parameters": {SURROGATE_ARGS}}}]'),
])
def test_lone_surrogates_in_a_call_stay_valid_json_that_utf8_can_carry(stream, text):
    for step in (1, len(text)):
        _, (content, calls) = fed_in_pieces(stream(), text, step)
        assert content is None and len(calls) == 1
        call = calls[0]
        call.name.encode()  # would raise UnicodeEncodeError for a lone surrogate
        call.arguments.encode()
        assert call.name == "get\\ud800"  # a name is plain text: the escape's characters
        # The arguments mean what the model wrote (a valid pair is one character).
        assert json.loads(call.arguments) == {"city": "Par\ud800is", "note": "\udfff", "ok": "\U0001F600"}
