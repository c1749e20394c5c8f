"""/v1/completions with echo and logprobs, as lm-evaluation-harness's loglikelihood tasks use it:
the prompt's logprobs in OpenAI's legacy shape, equal to transformers'; max_tokens 0 with echo (the
prompt alone, scored); streaming; text offsets; vLLM's prompt_logprobs. Real server on loopback,
the real openai client."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_harness import MODEL

from pagedserve.sampling_params import SamplingParams

TOL = 1e-3  # per token, as the engine's logprob tests
# (context, continuation) pairs as lm-eval scores them: some continuations are the greedy ones.
PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " a purple banana"),
         ("One, two, three, four,", " five"), ("Water boils at 100 degrees", " Fahrenheit in space")]


@pytest.fixture(scope="module")
def scored(embedded_tokenizer, embedded_hf_model):
    """Each pair as lm-eval sends it (context ids + continuation ids, one prompt of a batch), with
    transformers' answer: (ids, context length, sum of the continuation's logprobs, is greedy)."""
    out = []
    for context, continuation in PAIRS:
        ctx, cont = embedded_tokenizer.encode(context), embedded_tokenizer.encode(continuation)
        ids = ctx + cont
        with torch.no_grad():
            ref = torch.log_softmax(embedded_hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        positions = range(len(ctx), len(ids))
        out.append((ids, len(ctx), sum(ref[p - 1, ids[p]].item() for p in positions),
                    all(int(ref[p - 1].argmax()) == ids[p] for p in positions)))
    return out


def loglikelihood(choice, context_length: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs for the completions API: the continuation's summed logprobs, and
    whether each of its tokens is the most likely one. The last entry (the generated token) is cut."""
    token_logprobs = choice.logprobs.token_logprobs[context_length:-1]
    top_logprobs = choice.logprobs.top_logprobs[context_length:-1]
    return sum(token_logprobs), all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))


def test_lm_eval_loglikelihood_request_matches_transformers(server, scored):
    assert {greedy for *_, greedy in scored} == {True, False}  # both cases are exercised
    # lm-eval's exact body (LocalCompletionsAPI._create_payload, generate=False), a batch of token-id prompts.
    r = server.client().completions.create(model=MODEL, prompt=[ids for ids, *_ in scored], max_tokens=1, logprobs=1,
                                           echo=True, temperature=0, seed=1234)
    assert len(r.choices) == len(scored)
    for choice, (ids, context_length, reference, greedy) in zip(sorted(r.choices, key=lambda c: c.index), scored):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # the token itself and the top 1
        total, is_greedy = loglikelihood(choice, context_length)
        assert total == pytest.approx(reference, abs=TOL * (len(ids) - context_length))
        assert is_greedy == greedy
    assert r.usage.completion_tokens == len(scored)


def test_max_tokens_0_with_echo_returns_the_prompt_alone_scored(server, scored, embedded_tokenizer):
    client = server.client()
    ids, context_length, reference, greedy = scored[1]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == embedded_tokenizer.decode(ids) and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    assert len(choice.logprobs.token_logprobs) == len(ids)  # no generated token
    continuation = choice.logprobs.token_logprobs[context_length:]
    assert sum(continuation) == pytest.approx(reference, abs=TOL * len(continuation))
    # The same entries as a max_tokens 1 request's, less its generated token.
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert one.choices[0].logprobs.token_logprobs[:-1] == choice.logprobs.token_logprobs
    # Text prompts and no logprobs: just the prompt back.
    plain = client.completions.create(model=MODEL, prompt=["Hello there", "Hi"], max_tokens=0, echo=True)
    assert [c.text for c in plain.choices] == ["Hello there", "Hi"] and plain.usage.completion_tokens == 0


def test_max_tokens_0_without_echo_is_a_400_naming_max_tokens(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "echo" in error["message"] and error["type"] == "invalid_request_error"


def joined(chunks) -> dict[int, tuple[str, dict[str, list]]]:
    """Per choice: its streamed text and its logprobs' lists, concatenated over the chunks."""
    out: dict[int, tuple[str, dict[str, list]]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            text, lists = out.get(c.index, ("", {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                 "text_offset": []}))
            for name, values in lists.items():
                values += getattr(c.logprobs, name)
            out[c.index] = (text + c.text, lists)
    return out


def as_lists(choice) -> tuple[str, dict[str, list]]:
    lp = choice.logprobs
    return choice.text, {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "top_logprobs": lp.top_logprobs,
                         "text_offset": lp.text_offset}


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_a_stream_opens_with_the_prompt_s_entries_and_adds_up_to_the_whole_answer(server, scored, max_tokens):
    client = server.client()
    ids = scored[0][0]
    body = dict(model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0, n=2)
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True))
    for index in (0, 1):
        opening = next(c.choices[0] for c in chunks if c.choices and c.choices[0].index == index)
        assert len(opening.logprobs.tokens) >= len(ids) and opening.logprobs.token_logprobs[0] is None
    assert joined(chunks) == {c.index: as_lists(c) for c in whole.choices}


@pytest.mark.parametrize("prompt", ["The sky is blue. It is also", "Café — naïve 日本語 text"])
def test_text_offsets_index_the_returned_text(server, embedded_tokenizer, prompt):
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=0,
                                           temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    num_prompt = len(embedded_tokenizer.encode(prompt))
    assert text.startswith(prompt) and offsets[0] == 0 and offsets[num_prompt] == len(prompt)
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:  # a piece of a character split over tokens decodes as U+FFFD alone
            assert text[offset:].startswith(token), (token, offset)
    if prompt.isascii():  # every token whole: the tokens tile the prompt
        assert "".join(tokens[:num_prompt]) == prompt
        assert [text[a:b] for a, b in zip(offsets, offsets[1:num_prompt + 1])] == tokens[:num_prompt]


def test_prompt_logprobs_as_vllm_returns_them(server, offline, scored):
    ids = scored[0][0]
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}, timeout=60)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None  # not asked for
    expected = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2),
                                use_tqdm=False)[0].prompt_logprobs
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    for got, want in zip(choice["prompt_logprobs"][1:], expected[1:]):
        assert list(got) == [str(t) for t in want]  # JSON keys are token ids as strings; the prompt token first
        for t, lp in want.items():
            assert got[str(t)]["rank"] == lp.rank and got[str(t)]["decoded_token"] == lp.decoded_token
            assert got[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
    # A stream carries them in each choice's first chunk.
    stream = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 3,
                                                             "prompt_logprobs": 2, "stream": True}, timeout=60)
    events = [json.loads(line[len("data: "):]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:] if e["choices"])
    # Left out when not asked for; with echo's larger count, trimmed to what was asked.
    plain = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    both = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True,
                                                           "logprobs": 3, "prompt_logprobs": 0}).json()["choices"][0]
    assert all(len(entry) == 1 for entry in both["prompt_logprobs"][1:])
    assert all(len(top) >= 3 for top in both["logprobs"]["top_logprobs"][1:])
