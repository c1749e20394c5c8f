"""Tools and tool history in the prompt: the messages and the `tools` a chat template gets.

A template that renders tools (its source uses the `tools` variable, as Qwen's, Hermes' or Llama
3.1's do) gets them as they are: `tools` for the tool list, assistant messages with `tool_calls`
(arguments as objects, as Hugging Face templates expect), and `tool` messages.

A template that does not (the embedded SmolLM2's renders role and content only) would drop the
tools without a word, so the server writes them into the text itself, in the format of the tool
parser it reads calls with:
- the tools, and how to call them, go in a block at the end of the system message (a system
  message is added when there is none);
- tool results become a user message (such templates know the roles system, user and assistant
  only) that says which call each result is of, `Result of the function call name({arguments}):`,
  and asks for the answer. A call whose result is there moves into that message, out of the
  assistant's turn: a small model copies its last turn, so a call left there is called again, and
  a result in tags (`<tool_response>`) is answered with the tags. The message joins the user turn
  before it when the assistant's turn had nothing else, as templates that want user and assistant
  turns to alternate require;
- an assistant's call without a result is written into its content as the model would have written
  it (`<tool_call>...</tool_call>` for hermes).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jinja2
import jinja2.meta

from pagedserve.entrypoints.openai.protocol import ChatMessage, HistoryToolCall
from pagedserve.entrypoints.openai.tool_parsers import ToolCall, ToolParser


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template uses the `tools` variable."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: transformers takes "tool_use" when given tools
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and _uses_tools(template)


@functools.lru_cache(maxsize=16)
def _uses_tools(source: str) -> bool:
    try:  # the variables the template reads, not the word anywhere (a comment, a string)
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): read the text
        return re.search(r"\btools\b", source) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def chat_turns(messages: list[ChatMessage], tools: list[dict[str, Any]] | None, parser: ToolParser,
               native: bool) -> list[dict[str, Any]]:
    """The conversation as the template takes it. `tools` (OpenAI's tool objects) are to be passed
    to the template as `tools` when it renders them (`native`); else `parser` writes them, and the
    history's calls, into the text."""
    if native:
        return _native_turns(messages)
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    calls_by_id = {c.id: c for m in messages for c in m.tool_calls or []}
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role == "tool":
            result = f"{_result_label(calls_by_id.get(m.tool_call_id))}:\n{m.text()}"
            if i and messages[i - 1].role == "tool":  # one message for consecutive results
                asked = turns[-1]["content"].removesuffix(_ASK_ONE).removesuffix(_ASK_MANY)
                turns[-1]["content"] = f"{asked}\n\n{result}{_ASK_MANY}"
            elif turns and turns[-1]["role"] == "user":
                turns[-1]["content"] += f"\n\n{result}{_ASK_ONE}"
            else:
                turns.append({"role": "user", "content": result + _ASK_ONE})
        elif m.tool_calls:
            unanswered = [ToolCall(c.function.name, c.function.arguments) for c in m.tool_calls
                          if c.id not in answered]
            parts = [m.text()] if m.text() else []
            parts += [parser.format_calls(unanswered)] if unanswered else []
            if parts:
                turns.append({"role": role, "content": "\n".join(parts)})
        else:
            turns.append({"role": role, "content": m.text()})
    if tools:
        block = parser.instructions(tools)
        if turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{block}" if turns[0]["content"] else block
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


_ASK_ONE = "\n\nAnswer with this result."
_ASK_MANY = "\n\nAnswer with these results."


def _result_label(call: HistoryToolCall | None) -> str:
    if call is None:  # a result whose call is not in the conversation
        return "Result of a function call"
    return f"Result of the function call {call.function.name}({call.function.arguments})"


def _native_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or []}
    turns = []
    for m in messages:
        turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                                  for c in m.tool_calls]
        if m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names:  # some templates name the function a result comes from
                turn["name"] = names[m.tool_call_id]
        turns.append(turn)
    return turns
