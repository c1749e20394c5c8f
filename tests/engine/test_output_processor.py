"""The front's OutputProcessor on hand-made core outputs: what it does when the core runs ahead of
a stop string (in its own process it does), when the core stops on a token, and when the front
itself fails on one request."""

from __future__ import annotations

import msgspec

from pagedserve.core.messages import SampleOutput, TokenLogprobs
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import SamplingParams


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(processor, request_id, index, tokens, **kwargs):
    """One output per token, as the core sends them step by step; the last step's result."""
    result = None
    for k, token in enumerate(tokens):
        last = k == len(tokens) - 1
        result = processor.process([SampleOutput(request_id, index, [token], **(kwargs if last else {}))])
    return result


def test_a_stop_string_ends_the_sample_and_later_tokens_are_dropped(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    processor.add_request("a", "p", [1, 2, 3], SamplingParams(n=2, stop=["blue"]), 0.0)
    tokens = ids(tok, "The sky is blue today")
    outputs = []
    stopped = []
    for token in tokens:
        result = processor.process([SampleOutput("a", 0, [token])])
        outputs += result.outputs
        stopped += result.stopped
    assert stopped == [("a", 0)]  # told once, at the token that completed "blue"
    final = outputs[-1].outputs[0]
    assert final.text == "The sky is " and final.finish_reason == "stop" and final.stop_reason == "blue"
    # The tokens the core produced after the stop (it had not heard yet) are not in the output.
    assert final.token_ids == tokens[:len(final.token_ids)] and len(final.token_ids) < len(tokens)
    assert not outputs[-1].finished  # sample 1 still runs
    done = feed(processor, "a", 1, ids(tok, " ok"), finish_reason="length")
    assert done.outputs[0].finished and done.outputs[0].outputs[1].text == " ok"
    assert "a" not in processor


def test_a_stop_token_s_text_is_left_out_unless_asked_for(embedded_tokenizer):
    tok = embedded_tokenizer
    word = ids(tok, " end")
    for keep in (False, True):
        processor = OutputProcessor(tok)
        processor.add_request("r", None, [5], SamplingParams(include_stop_str_in_output=keep), 0.0)
        result = feed(processor, "r", 0, ids(tok, "Hello") + word, finish_reason="stop", stop_reason=word[-1])
        out = result.outputs[0].outputs[0]
        assert out.text == ("Hello end" if keep else "Hello") and out.stop_reason == word[-1]
        assert result.stopped == []  # the core stopped it itself


def test_logprobs_are_decoded_in_the_front(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [5], SamplingParams(logprobs=1), 0.0)
    [a, b] = ids(tok, "Hello world")
    result = processor.process([SampleOutput("r", 0, [a], [TokenLogprobs(-0.5, 2, [(b, -0.1)])], finish_reason="length")])
    out = result.outputs[0].outputs[0]
    assert out.cumulative_logprob == -0.5
    assert {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in out.logprobs[0].items()} == {
        a: (-0.5, 2, tok.decode([a])), b: (-0.1, 1, tok.decode([b]))}


def test_prompt_logprobs_arrive_once_and_take_vllm_s_shape(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    [a, b, c, x, y] = ids(tok, "Hello big world again now")
    processor.add_request("r", None, [a, b, c], SamplingParams(prompt_logprobs=1, max_tokens=2), 0.0)
    sent = SampleOutput("r", 0, [y], prompt_logprobs=[TokenLogprobs(-3.0, 7, [(x, -0.5)]),
                                                      TokenLogprobs(-0.2, 1, [(c, -0.2)])])
    # As it crosses from a core process: msgpack, no pickle.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=SampleOutput)
    first = processor.process([wire]).outputs[0]
    expected = [None,
                {b: Logprob(-3.0, 7, tok.decode([b])), x: Logprob(-0.5, 1, tok.decode([x]))},
                {c: Logprob(-0.2, 1, tok.decode([c]))}]
    assert first.prompt_logprobs == expected
    assert [list(entry) for entry in first.prompt_logprobs[1:]] == [[b, x], [c]]  # the prompt token first
    last = processor.process([SampleOutput("r", 0, [x], finish_reason="length")]).outputs[0]
    assert last.finished and last.prompt_logprobs == expected  # cumulative outputs keep them


def test_a_front_failure_fails_that_request_only(embedded_tokenizer):
    tok = embedded_tokenizer
    processor = OutputProcessor(tok)
    for rid in ("ok", "bad"):
        processor.add_request(rid, None, [5], SamplingParams(), 0.0)

    def broken(token_ids):
        raise RuntimeError("detokenizer exploded")

    processor._requests["bad"].samples[0].detokenizer.add_tokens = broken
    [h] = ids(tok, "Hi")
    result = processor.process([SampleOutput("bad", 0, [h]), SampleOutput("ok", 0, [h])])
    assert result.failed == ["bad"]  # to be aborted in the core
    by_id = {o.request_id: o for o in result.outputs}
    assert by_id["bad"].finished and "detokenizer exploded" in by_id["bad"].error
    assert by_id["bad"].outputs[0].finish_reason == "error"
    assert by_id["ok"].error is None and by_id["ok"].outputs[0].text == "Hi" and not by_id["ok"].finished
    assert "bad" not in processor and "ok" in processor


def test_a_core_error_ends_every_sample(embedded_tokenizer):
    processor = OutputProcessor(embedded_tokenizer)
    processor.add_request("r", None, [5], SamplingParams(n=2), 0.0)
    result = processor.process([SampleOutput("r", i, [], finish_reason="error", error="boom") for i in range(2)])
    [out] = result.outputs
    assert out.finished and out.error == "boom" and [o.finish_reason for o in out.outputs] == ["error", "error"]
