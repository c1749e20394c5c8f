"""The OpenAI-compatible server through the real `openai` client: outputs equal the offline API's,
every sampling field reaches the engine, usage adds up, and /metrics follows what ran."""

import asyncio

import httpx
import openai
import pytest
from server_harness import MODEL, assert_all_free, read_metrics, serve, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.sampling_params import SamplingParams

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three fruits."}]


def offline_text(offline, prompt=PROMPT, **params):
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs


def stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text by choice index, finish reason by index, all chunks) of a completion stream."""
    texts, reasons, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def test_models_health_and_openapi(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 2048
    assert httpx.get(f"{server.url}/health").status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


def test_greedy_completion_equals_the_offline_output(server, offline, embedded_tokenizer):
    client = server.client()
    expected = offline_text(offline, max_tokens=12, temperature=0)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == expected.text and expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(embedded_tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens, len(expected.token_ids), prompt_tokens + len(expected.token_ids))

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, chunks = stream_texts(stream)
    assert texts == {0: expected.text} and reasons == {0: expected.finish_reason}
    assert len(chunks) > 3  # it streamed, token by token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_greedy_chat_equals_the_offline_output(server, offline, embedded_tokenizer):
    client = server.client()
    expected = offline.chat(MESSAGES, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.outputs[0].text and expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        expected.outputs[0].finish_reason]
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_max_tokens_defaults_to_the_context_limit(server):
    # Without max_tokens, min_tokens=20 is valid (it would not be under completions' default of 16);
    # the first stop string after those 20 tokens ends the request.
    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stop=["\n", "."],
                                                extra_body={"min_tokens": 20})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens >= 20


def test_n_and_seed(server, offline):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=10, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.text for c in r.choices]
    assert texts[0] != texts[1]  # two samples, not one twice
    assert r.usage.completion_tokens == 20
    # Seeded sampling does not depend on the batch: the offline API draws the same.
    expected = offline_text(offline, n=2, max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    assert texts == [o.text for o in expected]
    streamed, reasons, _ = stream_texts(client.completions.create(**kwargs, stream=True))
    assert streamed == {0: texts[0], 1: texts[1]} and reasons == {0: "length", 1: "length"}
    other = client.completions.create(**(kwargs | {"seed": 99}))
    assert [c.text for c in other.choices] != texts

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0,
                                          seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


def test_stop_strings(server, offline):
    client = server.client()
    full = offline_text(offline, max_tokens=16, temperature=0)[0].text
    stop = full[8:12]
    assert stop.strip(), full  # guards the test: a visible piece of the greedy text
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "zzzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    texts, reasons, _ = stream_texts(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                                               temperature=0, stop=stop, stream=True))
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_completion_logprobs(server, offline):
    client = server.client()
    ref = offline_text(offline, max_tokens=6, temperature=0, logprobs=3)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [entry[t].decoded_token for t, entry in zip(ref.token_ids, ref.logprobs)]
    assert lp.token_logprobs == pytest.approx([entry[t].logprob for t, entry in zip(ref.token_ids, ref.logprobs)],
                                              abs=1e-4)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy takes the top token

    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True)]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [e.token for s in streamed for e in s.content] == [e.token for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo(server, offline):
    client = server.client()
    expected = offline_text(offline, max_tokens=5, temperature=0)[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + expected
    texts, _, _ = stream_texts(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                                         echo=True, stream=True))
    assert texts == {0: PROMPT + expected}


def test_prompt_as_texts_and_token_ids(server, offline, embedded_tokenizer):
    client = server.client()
    prompts = [PROMPT, "Paris is the capital of"]
    expected = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(max_tokens=5, temperature=0),
                                                            use_tqdm=False)]
    ids = [embedded_tokenizer.encode(p) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [(c.index, c.text) for c in r.choices] == list(enumerate(expected))
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    r = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=5, temperature=0)
    assert r.choices[0].text == expected[1]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, expected[0]), (1, expected[0]), (2, expected[1]),
                                                      (3, expected[1])]
    texts, _, _ = stream_texts(client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                                         stream=True))
    assert texts == dict(enumerate(expected))
    m = server.wait_idle()
    assert_all_free(m)


def test_200_requests_from_32_concurrent_clients(server, embedded_tokenizer):
    before = server.metrics()
    jobs: asyncio.Queue = asyncio.Queue()

    def chat_prompt_tokens(messages):
        text = embedded_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(embedded_tokenizer.encode(text, add_special_tokens=False))

    async def run(client, i):
        """One request of four kinds; returns (usage, expected prompt tokens, max_tokens)."""
        max_tokens, kind, extra = 2 + i % 5, i % 4, {"ignore_eos": True}
        prompt = f"Fact {i}:"  # short: the engine's compute is what this test spends its time on
        messages = [{"role": "user", "content": prompt}]
        if kind == 0:
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body=extra)
            assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
            return r.usage, len(embedded_tokenizer.encode(prompt)), max_tokens
        if kind == 1:
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, extra_body=extra)
            return r.usage, chat_prompt_tokens(messages), max_tokens
        options = {"include_usage": True}
        if kind == 2:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                     stream_options=options, extra_body=extra)
            expected = len(embedded_tokenizer.encode(prompt))
        else:
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                          stream=True, stream_options=options, extra_body=extra)
            expected = chat_prompt_tokens(messages)
        chunks = [c async for c in stream]
        return chunks[-1].usage, expected, max_tokens

    async def client_loop(results):
        client = server.async_client()
        while not jobs.empty():
            i = jobs.get_nowait()
            results[i] = await run(client, i)
        await client.close()

    async def main():
        for i in range(200):
            jobs.put_nowait(i)
        results = {}
        await asyncio.gather(*(client_loop(results) for _ in range(32)))
        return results

    results = asyncio.run(main())
    assert sorted(results) == list(range(200))
    for usage, prompt_tokens, max_tokens in results.values():
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, max_tokens)
        assert usage.total_tokens == prompt_tokens + max_tokens
    after = server.metrics()
    assert_all_free(after)

    def delta(name):
        return after[name] - before[name]

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u, _, _ in results.values())
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u, _, _ in results.values())
    assert delta("vllm:request_success_total:length") == 200
    assert delta("vllm:e2e_request_latency_seconds_count") == 200
    assert delta("vllm:time_to_first_token_seconds_count") == 200


def test_streaming_clients_that_disconnect_are_aborted(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def one(client):
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return line  # leaving the block closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(20)))

    assert all(asyncio.run(main()))
    after = server.wait_idle()
    assert after["vllm:request_success_total:abort"] - before["vllm:request_success_total:abort"] == 20
    assert after["vllm:request_success_total:length"] == before["vllm:request_success_total:length"]
    assert_all_free(after)


def test_a_non_streaming_client_that_disconnects_is_aborted(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", timeout=httpx.Timeout(30, read=1.0),
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True})
    after = server.wait_idle()
    assert after["vllm:request_success_total:abort"] - before["vllm:request_success_total:abort"] == 1
    assert_all_free(after)


def test_metrics_parse_and_move(server):
    client = server.client()
    before = server.metrics()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_success_total:stop",
                 "pagedserve:kv_offload_hits_total", "pagedserve:kv_offload_stored_blocks_total",
                 "pagedserve:kv_offload_loaded_blocks_total"]:
        assert name in before
    prompt = "A prompt long enough to fill two blocks of sixteen tokens, so that the second time it is sent the " \
             "prefix cache has something to give back."
    usages = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True}).usage
              for _ in range(2)]
    after = server.metrics()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * usages[0].prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 6
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 16
    for histogram in ["time_to_first_token_seconds", "request_time_per_output_token_seconds",
                      "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_inference_time_seconds"]:
        name = f"vllm:{histogram}"
        assert after[f"{name}_count"] - before[f"{name}_count"] == 2
        assert after[f"{name}_sum"] > before[f"{name}_sum"]
        assert after[f"{name}_bucket:+Inf"] == after[f"{name}_count"]

    def added(histogram):
        return after[f"vllm:{histogram}_sum"] - before[f"vllm:{histogram}_sum"]

    # The phases add up: TTFT = queue + prefill, E2E = queue + inference = TTFT + decode.
    assert added("request_queue_time_seconds") + added("request_prefill_time_seconds") == pytest.approx(
        added("time_to_first_token_seconds"))
    assert added("request_queue_time_seconds") + added("request_inference_time_seconds") == pytest.approx(
        added("e2e_request_latency_seconds"))
    assert added("time_to_first_token_seconds") + added("request_decode_time_seconds") == pytest.approx(
        added("e2e_request_latency_seconds"))
    assert_all_free(after)


def test_api_key(server):
    with serve(build_app(server.async_engine, MODEL, api_key="sk-test")) as url:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models/x"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/tokenizer_info")]:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}]:
                r = httpx.request(method, url + path, headers=headers, content=b"{not json")
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(f"{url}/health").status_code == 200  # outside /v1: open
        assert read_metrics(url)["vllm:e2e_request_latency_seconds_count"] == 1  # its own registry
    # The first server, on the same engine, is unaffected and needs no key.
    assert server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices


def test_the_dashboard_takes_exactly_one_api_key_in_its_query(server):
    with serve(build_app(server.async_engine, MODEL, api_key="sk-test")) as url:
        assert httpx.get(f"{url}/dashboard?api_key=sk-test").status_code == 200
        # Whichever of two keys a parser would pick (the first, the last), two are refused.
        for query in ("api_key=sk-test&api_key=wrong", "api_key=wrong&api_key=sk-test",
                      "api_key=sk-test&api_key=sk-test", "api_key=&api_key=sk-test", "api%5Fkey=wrong&api_key=sk-test"):
            for path in ("/dashboard", "/dashboard/events"):
                r = httpx.get(f"{url}{path}?{query}", headers={"Authorization": "Bearer sk-test"})
                assert r.status_code == 400, (path, query)
                error = r.json()["error"]
                assert error["param"] == "api_key" and "api_key" in error["message"], error
                assert error["type"] == "invalid_request_error"



def test_the_operators_default_max_tokens(embedded_model, embedded_tokenizer):
    """`--override-generation-config '{"max_new_tokens": 5}'`: max_tokens for a request that sets none;
    a request's own still wins, the context check still applies, and the default never overruns the
    context. (Its own small engine, so that a prompt can fill the context quickly.)"""
    context = 128
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=context), model=embedded_model,
                       tokenizer=embedded_tokenizer)
    with serve_engine(engine, default_max_tokens=5) as small:
        client = small.client()
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
        assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 7
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=context)
        # Completions: an omitted max_tokens is OpenAI's 16; an explicit null takes the default.
        r = httpx.post(f"{small.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": None, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
        # Three tokens of room left in the context: three, not five, and no error.
        r = httpx.post(f"{small.url}/v1/completions",
                       json={"prompt": [1] * (context - 3), "max_tokens": None, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
        assert_all_free(small.wait_idle())
