"""The request models: strict JSON types, unknown fields allowed, nulls meaning the defaults."""

import pytest
from pydantic import ValidationError

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.sampling_params import SamplingParams


def test_values_of_the_wrong_json_type_are_refused_not_coerced():
    for bad in [{"max_tokens": "5"}, {"max_tokens": 5.0}, {"max_tokens": True}, {"temperature": "0.5"},
                {"echo": 1}, {"stop": 3}, {"stream_options": {"include_usage": "true"}}]:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "hi"} | bad)
    assert CompletionRequest.model_validate({"prompt": "hi", "temperature": 1}).temperature == 1.0  # int is a number


def test_unknown_fields_are_allowed():
    request = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"50256": -100}, "suffix": None})
    assert request.prompt == "hi"


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([], []),
])
def test_the_four_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


def test_nulls_and_absent_fields_take_the_defaults():
    explicit_nulls = {name: None for name in ["n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                              "presence_penalty", "frequency_penalty", "repetition_penalty",
                                              "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                                              "include_stop_str_in_output", "max_tokens", "logprobs", "echo"]}
    for body in [{"prompt": "hi"}, {"prompt": "hi"} | explicit_nulls]:
        request = CompletionRequest.model_validate(body)
        assert request.to_sampling_params(16, None) == SamplingParams(max_tokens=16)


def test_sampling_fields_reach_the_sampling_params():
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "stop": "x",
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 1,
        "ignore_eos": True, "stop_token_ids": [7], "include_stop_str_in_output": True, "skip_special_tokens": False,
    })
    assert request.messages[0].text() == "a\nb"  # text parts joined with a newline, as vLLM joins them
    assert request.to_sampling_params(9, 2) == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["x"], presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, min_tokens=1, ignore_eos=True, stop_token_ids=[7],
        include_stop_str_in_output=True, skip_special_tokens=False, max_tokens=9, logprobs=2)
    with pytest.raises(ValueError, match="min_tokens"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}],
                                              "min_tokens": 5}).to_sampling_params(4, None)


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}  # "type": "object" left implicit


def test_tool_choice_defaults_as_openai_auto_with_tools_and_none_without():
    assert _chat().resolved_tool_choice() == "none"
    assert _chat(tools=[]).resolved_tool_choice() == "none"
    assert _chat(tools=[NOW]).resolved_tool_choice() == "auto"
    assert _chat(tools=[NOW], tool_choice="none").resolved_tool_choice() == "none"
    assert _chat(tools=[NOW]).to_sampling_params(8, None).structured_outputs is None  # "auto" constrains nothing


def test_a_named_function_constrains_the_output_to_its_arguments():
    params = _chat(tools=[NOW, ADD], tool_choice={"type": "function", "function": {"name": "add"}}).to_sampling_params(
        8, None).structured_outputs
    assert params.json == {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert params.disable_any_whitespace
    now = _chat(tools=[NOW], tool_choice={"type": "function", "function": {"name": "now"}}).tool_schema()
    assert now == {"type": "object", "properties": {}}  # no parameters: an empty object, never any JSON


def test_required_constrains_the_output_to_an_array_of_calls_one_when_not_parallel():
    def call(name, parameters):
        return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"], "additionalProperties": False}

    schema = _chat(tools=[NOW, ADD], tool_choice="required").tool_schema()
    assert schema == {"type": "array", "minItems": 1, "items": {"anyOf": [
        call("now", {"type": "object", "properties": {}}),
        call("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})]}}
    assert _chat(tools=[NOW], tool_choice="required", parallel_tool_calls=False).tool_schema()["maxItems"] == 1
