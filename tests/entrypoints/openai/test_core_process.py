"""The server as `pagedserve serve` runs it by default: the engine core in its own process.

Same answers as the offline API, over the real `openai` client; and when the core process dies,
the requests in flight end at once with a 503 (an error event and [DONE] in a started stream),
/health answers 503 until a new core serves, and then everything works again; a core that cannot
come back ends the server with exit code 1; a stopped core turns /health 503 until it runs; big
schemas compiling at once leave a neighbour's stream even."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import MODEL, Server, assert_all_free, serve

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import build_app


pytestmark = pytest.mark.slow  # a server over an engine core process, and processes killed and restarted

STALL_TIMEOUT = 3.0  # short, for the stopped-core test; a step of these tests takes well under it


@pytest.fixture(scope="module")
def process_server(embedded_tokenizer):
    # The front shares the session's tokenizer; the core process loads the model itself, dequantized as
    # the offline reference's copy is (the GGUF's own formats round differently on some CPUs).
    engine = AsyncLLM(EngineConfig(num_kv_blocks=512, max_model_len=2048, quantization="none"),
                      tokenizer=embedded_tokenizer,
                      stall_timeout=STALL_TIMEOUT)
    engine.start()
    try:
        with serve(build_app(engine, MODEL)) as url:
            yield Server(url, None, engine)
    finally:
        engine.shutdown()
    assert not engine.client._process.is_alive()


def test_greedy_answers_equal_the_offline_api(process_server, offline):
    client = process_server.client()
    prompt = "The capital of France is"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    want = offline.generate([prompt], offline_params(16))[0].outputs[0]
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    want = offline.chat([messages], offline_params(12))[0].outputs[0]
    assert chat.choices[0].message.content == want.text

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def offline_params(max_tokens):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_a_bad_request_is_a_400_naming_the_field(process_server):
    r = httpx.post(f"{process_server.url}/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, "top_k": 2**63})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_structured_output_in_the_core_process(process_server, offline):
    """The core process has no tokenizer of its own: its first constrained request loads the
    checkpoint's vocabulary to compile the grammar. Same answer as the offline API."""
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "year": {"type": "integer"}},
              "required": ["city", "year"]}
    got = process_server.client().completions.create(model=MODEL, prompt="A trip:", max_tokens=40, temperature=0,
                                                     extra_body={"guided_json": schema})
    want = offline.generate(["A trip:"], SamplingParams(max_tokens=40, temperature=0.0,
                                                        structured_outputs=StructuredOutputsParams(json=schema)))
    assert got.choices[0].text == want[0].outputs[0].text
    assert json.loads(got.choices[0].text)["city"] in ("Paris", "Rome")


@pytest.mark.slow
@pytest.mark.timing
def test_three_big_schemas_compiling_at_once_keep_a_neighbours_gaps_even(process_server):
    """Three schemas of 1,000 properties sent at once (seconds of compiling each, more than the
    cores hold beside the steps): the neighbour's stream slows evenly, its longest gap within 5x
    its median. Compiles beside the steps' threads gave gaps of seconds, 30-50x the median."""
    from pagedserve.bench.compile_gaps import measure_compile_gaps

    report = measure_compile_gaps(process_server.url, MODEL, concurrent=3, properties=1000, baseline_s=1.0)
    assert report["statuses"] == [200, 200, 200], report
    assert report["during"]["max_ms"] <= 5 * report["during"]["median_ms"], report
    assert_all_free(process_server.wait_idle())


def test_prompt_logprobs_cross_the_process_boundary(process_server, offline):
    from pagedserve.sampling_params import SamplingParams

    ids = offline.get_tokenizer().encode("The capital of France is Paris")
    got = process_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    want = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
    assert got.choices[0].logprobs.token_logprobs == [None] + [
        pytest.approx(want[p][ids[p]].logprob, abs=1e-5) for p in range(1, len(ids))]


def test_the_kv_dashboard_sees_the_core_process_pool(process_server):
    # The views travel from the core process as msgpack: the stream's first frame is the whole pool,
    # and a request's blocks show up while it runs.
    frames = []
    with httpx.stream("GET", f"{process_server.url}/dashboard/events", timeout=60) as response:
        threading.Thread(target=process_server.client().completions.create, daemon=True,
                         kwargs=dict(model=MODEL, prompt="Count slowly: one, two, three,", max_tokens=96,
                                     extra_body={"ignore_eos": True})).start()
        for line in response.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[len("data: "):]))
                if frames[-1]["engine"]["num_running"] == 1 and frames[-1]["counts"]["used"] > 0:
                    break
    assert frames[0]["num_blocks"] == 512 and len(frames[0]["cells"]) == 512
    (request,) = frames[-1]["requests"]
    assert request["status"] == "running" and len(request["blocks"]) == -(-request["num_tokens"] // 16)
    assert all(frames[-1]["cells"][b] == 1 for b in request["blocks"])
    assert_all_free(process_server.wait_idle())


@pytest.mark.timing
def test_the_core_dies_under_load_requests_end_with_503_and_a_new_core_serves(process_server):
    url, engine = process_server.url, process_server.async_engine
    assert httpx.get(f"{url}/health").status_code == 200
    before = process_server.metrics()
    results = {}

    def call(name, stream):
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                results[name] = (r.status_code, [line for line in r.iter_lines() if line])
        else:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            results[name] = (r.status_code, r.json())

    threads = [threading.Thread(target=call, args=(f"{kind}{i}", kind == "stream"))
               for kind in ("plain", "stream") for i in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while engine.stats.num_running < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    old_pid = engine.core_pid
    os.kill(old_pid, signal.SIGKILL)
    start = time.monotonic()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads) and time.monotonic() - start < 5
    for name in ("plain0", "plain1"):  # not started yet: an OpenAI-style 503
        status, body = results[name]
        assert status == 503 and body["error"]["code"] == "engine_unavailable", body
        assert "killed by signal SIGKILL" in body["error"]["message"]
    for name in ("stream0", "stream1"):  # started: an error event, then [DONE]
        status, lines = results[name]
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_unavailable" and "SIGKILL" in error["message"]

    health = httpx.get(f"{url}/health")  # the new core waits out the backoff (1 s) before it starts
    assert health.status_code == 503 and "restarting" in health.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the core did not come back"
        time.sleep(0.1)
    assert engine.core_pid != old_pid
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        assert str(old_pid) not in f.read().split()  # reaped: no zombie left

    got = process_server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                                     extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 4
    after = process_server.wait_idle()
    # /metrics moves again; its counters go on from before the restart, the 4 failures counted as errors.
    assert after["vllm:request_success_total:error"] == before["vllm:request_success_total:error"] + 4
    assert after["vllm:request_success_total:length"] == before["vllm:request_success_total:length"] + 1
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 4 * 1 + 4
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert_all_free(after)


@pytest.mark.timing
def test_a_stopped_core_turns_health_503_until_it_runs_again(process_server):
    url, engine = process_server.url, process_server.async_engine
    done = {}
    thread = threading.Thread(target=lambda: done.update(r=httpx.post(f"{url}/v1/completions", timeout=180, json={
        "model": MODEL, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True})))
    thread.start()
    deadline = time.monotonic() + 60
    while engine.stats.num_running < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(engine.core_pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + STALL_TIMEOUT + 30
        while (health := httpx.get(f"{url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "a stopped core left /health at 200"
            time.sleep(0.1)
        assert health.status_code == 503 and "no progress" in health.json()["error"]["message"]
    finally:
        os.kill(engine.core_pid, signal.SIGCONT)
    thread.join(timeout=180)
    assert done["r"].status_code == 200  # the core only paused: the request finishes
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_core_that_cannot_restart_makes_the_server_exit_non_zero(tmp_path):
    """`pagedserve serve` as a supervisor runs it: with no restarts left, the core's death ends the
    server with exit code 1 (and says why), rather than leaving it up and refusing everyone."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), "--num-kv-blocks", "64",
         "--max-model-len", "256", "--engine-max-restarts", "0"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "log", "w"))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        with open(f"/proc/{server.pid}/task/{server.pid}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        core = [pid for pid in children if "pagedserve-core" in _name(pid) or _is_spawned_core(pid)]
        assert len(core) == 1, children
        os.kill(core[0], signal.SIGKILL)
        assert server.wait(timeout=60) == 1
        assert "could not be restarted" in (tmp_path / "log").read_text()
    finally:
        server.kill()
        server.wait()


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read()


def _is_spawned_core(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline") as f:
        cmdline = f.read()
    return "multiprocessing.spawn" in cmdline and "resource_tracker" not in cmdline
