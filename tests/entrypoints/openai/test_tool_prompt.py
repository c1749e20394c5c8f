"""Tools and tool history in the prompt, for both kinds of chat template: one that renders tools
(here a small template set on a copy of the embedded tokenizer) gets them as they are; the
embedded SmolLM2's, which renders role and content only, gets them written into the text by the
server. The prompts are checked whole, through the chat endpoint's own chat_prompt."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.protocol import ChatMessage
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from pagedserve.entrypoints.openai.tool_prompt import template_renders_tools

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ARGS = '{"city": "Paris"}'
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]},
]

# A template that renders tools, calls and results in a form of its own (as Qwen's or Llama 3.1's do).
TOOL_TEMPLATE = (
    "{% if tools %}[tools]{{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }}]{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}"
    "{% if m.role == 'tool' %}[result of {{ m.tool_call_id }} {{ m.name }}]{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def serving(tokenizer, tool_call_parser: str | None = None) -> OpenAIServingChat:
    """The chat endpoint over a stand-in engine: chat_prompt needs the tokenizer only."""
    return OpenAIServingChat(SimpleNamespace(tokenizer=tokenizer), "m", tool_call_parser=tool_call_parser)


def messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


@pytest.fixture(scope="module")
def tool_tokenizer(embedded_tokenizer):
    tokenizer = copy.deepcopy(embedded_tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("template,renders", [
    (TOOL_TEMPLATE, True),
    ("{%- if tools is defined and tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}", True),
    # transformers' own tag, which plain Jinja cannot parse: the text decides.
    ("{% generation %}{{ tools }}{% endgeneration %}", True),
    ("{# tools are not supported #}{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% for m in messages %}{{ 'tools' + m.content }}{% endfor %}", False),
])
def test_a_template_renders_tools_when_it_reads_the_tools_variable(template, renders):
    assert template_renders_tools(SimpleNamespace(chat_template=template)) is renders


def test_the_embedded_template_does_not_render_tools(embedded_tokenizer):
    assert not template_renders_tools(embedded_tokenizer)


def test_a_template_that_renders_tools_gets_tools_calls_and_results_as_they_are(tool_tokenizer):
    text, ids = serving(tool_tokenizer).chat_prompt(messages(HISTORY), True, TOOLS)
    assert text == (
        f"[tools]{json.dumps(TOOLS)}\n"
        "[user]Weather in Paris and Rome?\n"
        '[assistant][call call_1]get_weather{"city": "Paris"}[call call_2]get_weather{"city": "Rome"}\n'
        "[tool]21 C[result of call_1 get_weather]\n"
        "[tool]25 C[result of call_2 get_weather]\n"
        "[assistant]")
    assert ids == tool_tokenizer.encode(text, add_special_tokens=False)


def test_without_tool_support_results_are_labelled_with_their_calls_in_the_users_turn(embedded_tokenizer):
    text, _ = serving(embedded_tokenizer).chat_prompt(messages(HISTORY), True, TOOLS)
    hermes = HermesToolParser()
    assert text == (
        f"<|im_start|>system\n{hermes.instructions(TOOLS)}<|im_end|>\n"  # in place of the template's default
        # The calls (their results are there) leave the assistant's turn, which had nothing else, and
        # both results join the user's turn: such templates know system, user and assistant only.
        "<|im_start|>user\nWeather in Paris and Rome?\n\n"
        f"Result of the function call get_weather({ARGS}):\n21 C\n\n"
        'Result of the function call get_weather({"city": "Rome"}):\n25 C\n\n'
        "Answer with these results.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "<tool_response>" not in text

    third = messages([*HISTORY, {"role": "tool", "tool_call_id": "call_9", "content": "no call"}])
    text = serving(embedded_tokenizer).chat_prompt(third, True, TOOLS)[0]
    assert text.endswith("25 C\n\nResult of a function call:\nno call\n\nAnswer with these results.<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_without_tool_support_a_call_without_its_result_stays_in_the_assistants_turn(embedded_tokenizer):
    conversation = messages([*HISTORY[:2], {**HISTORY[2]}, {"role": "assistant", "content": "Rome next."}])
    text, _ = serving(embedded_tokenizer).chat_prompt(conversation, True, TOOLS)
    rome = HermesToolParser().format_calls(HermesToolParser().extract(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')[1])
    assert (f"<|im_start|>assistant\n{rome}<|im_end|>\n<|im_start|>user\n"
            f"Result of the function call get_weather({ARGS}):\n21 C\n\nAnswer with this result.<|im_end|>\n"
            "<|im_start|>assistant\nRome next.<|im_end|>") in text
    assert rome.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_the_tools_block_joins_the_system_message_in_the_servers_format(embedded_tokenizer):
    conversation = messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Checking.", "tool_calls": HISTORY[1]["tool_calls"][:1]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}])
    text, _ = serving(embedded_tokenizer, "llama3_json").chat_prompt(conversation, True, TOOLS)
    llama = Llama3JsonToolParser()
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{llama.instructions(TOOLS)}<|im_end|>\n")
    # The assistant's text stays in its turn; the call, answered, goes with its result.
    assert ("<|im_start|>assistant\nChecking.<|im_end|>\n<|im_start|>user\n"
            f"Result of the function call get_weather({ARGS}):\n21 C\n\nAnswer with this result.<|im_end|>") in text
    without_result = serving(embedded_tokenizer, "llama3_json").chat_prompt(conversation[:3], True, TOOLS)[0]
    assert f'<|im_start|>assistant\nChecking.\n{{"name": "get_weather", "parameters": {ARGS}}}<|im_end|>' in \
        without_result


def test_without_tools_a_conversation_renders_as_before(embedded_tokenizer):
    plain = messages([{"role": "user", "content": "Hi"}])
    text, _ = serving(embedded_tokenizer).chat_prompt(plain, True, None)
    assert text == embedded_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                          add_generation_prompt=True)


# ---- --tool-call-parser auto, and strict tools under "auto" per parser --------------------------


def test_auto_parser_is_the_templates_call_syntax_or_the_servers_format(embedded_tokenizer, tool_tokenizer):
    assert serving(embedded_tokenizer, "auto").tool_parser.name == "hermes"  # renders no tools: the server's format
    hermes_template = copy.deepcopy(embedded_tokenizer)
    hermes_template.chat_template = "{{ tools | tojson }}{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}"
    assert serving(hermes_template, "auto").tool_parser.name == "hermes"
    with pytest.raises(ValueError, match="--tool-call-parser auto: the chat template writes no tool-call syntax"):
        serving(tool_tokenizer, "auto")  # renders tools, in a syntax no parser reads


def test_strict_tools_under_auto_are_a_400_naming_tools_where_the_parser_has_no_tag(embedded_tokenizer):
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedserve.entrypoints.openai.serving_engine import APIError

    strict = {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}
    request = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "tools": [strict]})
    chat = OpenAIServingChat(SimpleNamespace(tokenizer=embedded_tokenizer), "m", enable_auto_tool_choice=True,
                             tool_call_parser="llama3_json")
    with pytest.raises(APIError) as info:
        chat.strict_calls_constraint(request)
    assert info.value.status == 400 and info.value.body.error.param == "tools"
    assert "strict is true for get_weather" in info.value.body.error.message
    assert "llama3_json" in info.value.body.error.message
    hermes = OpenAIServingChat(SimpleNamespace(tokenizer=embedded_tokenizer), "m", enable_auto_tool_choice=True,
                               tool_call_parser="hermes")
    assert hermes.strict_calls_constraint(request).structural_tag["format"]["triggers"] == ["<tool_call>"]
    not_strict = ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "tools": TOOLS})
    assert chat.strict_calls_constraint(not_strict) is None  # nothing to enforce: the output stays free
