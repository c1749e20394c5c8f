"""The offline API refuses what it cannot run with one ValueError naming the argument (and the item of
a list) and what is wrong, before anything is queued; text that is not valid Unicode says where."""

from __future__ import annotations

import re

import pytest

from pagedserve.config import EngineConfig
from pagedserve.sampling_params import BeamSearchParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=2)
BEAM = BeamSearchParams(beam_width=2, max_tokens=2)
CHAT = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def llm(embedded_model, embedded_tokenizer) -> LLM:
    return LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=2048), model=embedded_model,
                                     tokenizer=embedded_tokenizer))


def assert_nothing_left(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def surrogate_error(what: str, char: str, position: int) -> str:
    """The regex of check_unicode's message."""
    return f"^{re.escape(what)} is not valid Unicode: it holds a lone surrogate {re.escape(repr(char))} " \
           f"at position {position}$"


NOT_UNICODE = [
    # (call on an LLM, what the message names, the bad character, its position)
    (lambda llm: llm.generate(["\ud800"], GREEDY), "prompts[0]", "\ud800", 0),
    (lambda llm: llm.generate("ab\udfffc", GREEDY), "prompt", "\udfff", 2),
    (lambda llm: llm.generate({"prompt": "a\ud800"}, GREEDY), "prompt['prompt']", "\ud800", 1),
    (lambda llm: llm.generate(["fine", {"prompt": "xy\udc00", "prompt_token_ids": [1, 2]}], GREEDY),
     "prompts[1]['prompt']", "\udc00", 2),
    (lambda llm: llm.chat([{"role": "user", "content": "hi \ud800"}], GREEDY), "messages[0]['content']", "\ud800", 3),
    (lambda llm: llm.chat([CHAT, [*CHAT, {"role": "assistant", "content": [{"type": "text", "text": "ok\udbff"}]}]],
                          GREEDY), "messages[1][1]['content'][0]['text']", "\udbff", 2),
    (lambda llm: llm.chat(CHAT, GREEDY, chat_template="{{ messages[0].content }}\ud800"), "chat_template", "\ud800",
     25),
    (lambda llm: llm.beam_search(["ok", "\ud800!"], BEAM), "prompts[1]", "\ud800", 0),
]


@pytest.mark.parametrize(("call", "what", "char", "position"), NOT_UNICODE, ids=[c[1] for c in NOT_UNICODE])
def test_text_that_is_not_valid_unicode_says_where(llm, call, what, char, position):
    with pytest.raises(ValueError, match=surrogate_error(what, char, position)):
        call(llm)
    assert_nothing_left(llm)


def test_the_engine_checks_text_it_tokenizes(llm):
    """LLMEngine.tokenize (add_request's way in, and the server's) runs the same check."""
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=surrogate_error("the prompt", "\ud800", 5)):
        engine.tokenize("hello\ud800")
    with pytest.raises(ValueError, match=surrogate_error("the prompt", "\ud800", 0)):
        engine.add_request(engine.next_request_id(), "\ud800", GREEDY)
    assert_nothing_left(llm)
    assert engine.tokenize("Café 🙂")[1] == engine.tokenizer.encode("Café 🙂")


def test_valid_text_of_any_script_still_generates(llm):
    """Only lone surrogates are refused: a surrogate pair is one astral character, which is fine."""
    emoji = "\ud83d\ude42".encode("utf-16", "surrogatepass").decode("utf-16")  # the pair, joined: 🙂
    assert emoji == "🙂"
    outputs = llm.generate(["Café, 東京 and " + emoji], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 2
    outputs = llm.chat([{"role": "user", "content": "Say " + emoji}], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 2
    assert_nothing_left(llm)


WRONG_ARGUMENTS = [
    # (call on an LLM, the whole message as a regex)
    (lambda llm: llm.generate(None), r"prompts must be a prompt \(a str, a list of token ids or a dict\) or a list "
                                     r"of prompts, got None"),
    (lambda llm: llm.generate(3.5), r"prompts must be .* got float"),
    (lambda llm: llm.generate(b"hi"), r"prompts must be .* got bytes"),
    (lambda llm: llm.generate(["ok", None]), r"prompts\[1\] must be a str, a list of token ids or a dict, got None"),
    (lambda llm: llm.generate(["ok", 1.5]), r"prompts\[1\] must be a str, a list of token ids or a dict, got float"),
    (lambda llm: llm.generate([[1, 2.5]]), r"prompts\[0\] must be a list of int token ids, but it holds float 2\.5"),
    (lambda llm: llm.generate({"prompt": None}), r"prompt\['prompt'\] must be a str, got None"),
    (lambda llm: llm.generate([{"prompt": 7}]), r"prompts\[0\]\['prompt'\] must be a str, got int"),
    (lambda llm: llm.generate({"prompt_token_ids": "abc"}),
     r"prompt\['prompt_token_ids'\] must be a list of token ids, got str"),
    (lambda llm: llm.generate([{"text": "hi"}]), r"prompts\[0\]: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    (lambda llm: llm.generate(["x"], "bad"),
     r"sampling_params must be None, a SamplingParams or a list of them \(one per prompt\), got str"),
    (lambda llm: llm.generate(["x"], {"temperature": 0}), r"sampling_params must be .* got dict"),
    (lambda llm: llm.generate(["x", "y"], [GREEDY, None]), r"sampling_params\[1\] must be a SamplingParams, got None"),
    (lambda llm: llm.generate(["x"], [GREEDY, GREEDY]), r"got 2 SamplingParams for 1 prompts"),
    (lambda llm: llm.chat(None), r"messages must be a conversation \(a list of message dicts\) or a list of "
                                 r"conversations, got None"),
    (lambda llm: llm.chat("hi"), r"messages must be .* got str"),
    (lambda llm: llm.chat(["hi"]), r"messages\[0\] must be a list of message dicts, got str"),
    (lambda llm: llm.chat([*CHAT, "oops"]), r"messages\[1\] must be a message dict with 'role' and 'content', got str"),
    (lambda llm: llm.chat([{"content": "hi"}]), r"messages\[0\]\['role'\] must be a str, got None"),
    (lambda llm: llm.chat(CHAT, "bad"), r"sampling_params must be .* got str"),
    (lambda llm: llm.chat(CHAT, chat_template=5), r"chat_template must be a str or None, got int"),
    (lambda llm: llm.beam_search(None, BEAM), r"prompts must be .* got None"),
    (lambda llm: llm.beam_search(["ok", None], BEAM), r"prompts\[1\] must be a str, .* got None"),
    (lambda llm: llm.beam_search([[1, "2"]], BEAM), r"prompts\[0\] must be a list of int token ids, .* str '2'"),
    (lambda llm: llm.beam_search(["ok"], GREEDY), r"params must be a BeamSearchParams, got SamplingParams"),
]


@pytest.mark.parametrize(("call", "message"), WRONG_ARGUMENTS,
                         ids=[m.split()[0].replace("\\", "") for _, m in WRONG_ARGUMENTS])
def test_a_wrong_argument_is_one_value_error_naming_it(llm, call, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        call(llm)
    assert_nothing_left(llm)


def test_the_right_forms_still_work_after_all_that(llm):
    """Each accepted form of prompts and sampling_params, through the same checks."""
    engine = llm.llm_engine
    ids = engine.tokenizer.encode("The sky is")
    forms = ["The sky is", ["The sky is"], ("The sky is",), ids, [ids], {"prompt": "The sky is"},
             {"prompt_token_ids": ids}, {"prompt_token_ids": tuple(ids), "prompt": None}, (p for p in ["The sky is"])]
    texts = {llm.generate(form, GREEDY, use_tqdm=False)[0].outputs[0].text for form in forms}
    assert len(texts) == 1  # greedy: every form is the same prompt
    assert len(llm.generate(["a", "b"], (GREEDY, GREEDY), use_tqdm=False)) == 2
    assert llm.generate([], GREEDY) == [] and llm.chat([], GREEDY) == []
    assert len(llm.beam_search({"prompt": "The sky is"}, BEAM)) == 1
    assert_nothing_left(llm)
