"""The server as `pagedserve serve` runs it by default: the engine core in its own process.

Same answers as the offline API, over the real `openai` client; and when the core process dies,
the requests in flight end at once with a 503 (an error event and [DONE] in a started stream),
/health answers 503 until a new core serves, and then everything works again; a core that cannot
come back ends the server with exit code 1. A core stuck in a step (a fault injected into the core
process) is killed and replaced the same way, with or without requests in flight, and /health stays
503 until the new core's step loop runs; a core on a thread that is stuck ends the server. Big
schemas compiling at once leave a neighbour's stream even."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from server_harness import MODEL, Server, assert_all_free, serve

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import ProcessCoreClient
from pagedserve.engine.llm_engine import tokenizer_eos_ids
from pagedserve.entrypoints.openai.api_server import build_app
from tests.engine.fault_injection import run_faulty_core


pytestmark = pytest.mark.slow  # a server over an engine core process, and processes killed and restarted

BLOCK = 4242  # a prompt holding this token blocks the faulty core's step for good
STALL_TIMEOUT = 1.5  # short, for the stuck-core tests; their steps (a tiny model) take milliseconds


@pytest.fixture(scope="module")
def process_server(embedded_tokenizer):
    # The front shares the session's tokenizer; the core process loads the model itself, dequantized as
    # the offline reference's copy is (the GGUF's own formats round differently on some CPUs).
    engine = AsyncLLM(EngineConfig(num_kv_blocks=512, max_model_len=2048, quantization="none"),
                      tokenizer=embedded_tokenizer)
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
    cores hold beside the steps): the neighbour's stream slows evenly. Compiles beside the steps'
    threads gave gaps of seconds, 30-50x the median; now a quiet machine gives 2-5x and a
    busy one up to 7x, so the bound is 15x (the figure itself is `pagedserve bench structured --part gaps`)."""
    from pagedserve.bench.compile_gaps import measure_compile_gaps

    report = measure_compile_gaps(process_server.url, MODEL, concurrent=3, properties=1000, baseline_s=1.0)
    assert report["statuses"] == [200, 200, 200], report
    assert report["during"]["max_ms"] <= 15 * report["during"]["median_ms"], report
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


@contextmanager
def faulty_server(odd_checkpoint, tokenizer, hold, max_restarts=3):
    """A server over a core process with run_faulty_core's faults (a step blocks for good on BLOCK;
    a core whose loop starts while the file `hold` exists holds it) and a short stall timeout."""
    config = EngineConfig(model=str(odd_checkpoint[0]), num_kv_blocks=64, max_model_len=256,
                          max_num_batched_tokens=64)
    client = ProcessCoreClient(config, tokenizer_eos_ids(tokenizer), start_timeout=120, max_restarts=max_restarts,
                               restart_backoff=0.05, stall_timeout=STALL_TIMEOUT,
                               core_main=functools.partial(run_faulty_core, BLOCK, str(hold)))
    engine = AsyncLLM(config, tokenizer=tokenizer, client=client)
    engine.start()
    try:
        with serve(build_app(engine, MODEL)) as url:
            yield Server(url, None, engine)
    finally:
        engine.shutdown()
    assert not client._process.is_alive()


@pytest.fixture(scope="module")
def stuck_server(odd_checkpoint, embedded_tokenizer, tmp_path_factory):
    """faulty_server, and the file that holds its next core's step loop while it exists."""
    hold = tmp_path_factory.mktemp("faulty-core") / "hold"
    with faulty_server(odd_checkpoint, embedded_tokenizer, hold) as server:
        yield server, hold


def wait_for_health(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{url}/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health stayed {health.status_code}: {health.text}"
        time.sleep(0.05)
    return health


def test_a_core_stuck_in_a_step_is_killed_and_replaced(stuck_server):
    """The requests in flight end as for a core that died (503; an error event in a started stream);
    /health is 503 from the stall until the new core's step loop answers (not when it reports ready);
    then it serves again, and the restart is counted."""
    server, hold = stuck_server
    url, engine = server.url, server.async_engine
    restarts = engine.num_restarts
    wait_for_health(url, 200, 120)
    hold.touch()  # the next core holds its step loop until the test lets it go
    results = {}

    def stream():
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            results["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    def stuck():
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [BLOCK, 5, 6], "max_tokens": 4},
                       timeout=120)
        results["stuck"] = (r.status_code, r.json())

    tokens = engine.stats.num_generation_tokens
    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 60
    while engine.stats.num_generation_tokens < tokens + 2:  # the stream has started
        assert time.monotonic() < deadline
        time.sleep(0.01)
    blocked = threading.Thread(target=stuck)
    blocked.start()
    health = wait_for_health(url, 503, STALL_TIMEOUT + 30)
    assert "stalled" in health.json()["error"]["message"], health.json()
    streaming.join(timeout=30)
    blocked.join(timeout=30)
    status, body = results["stuck"]
    assert status == 503 and body["error"]["code"] == "engine_unavailable", body
    assert "stalled" in body["error"]["message"] and "SIGKILL" in body["error"]["message"]  # SIGTERM was ignored
    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "engine_unavailable"

    # The new core has reported ready but its step loop does not run: still 503, and refused.
    deadline = time.monotonic() + 120
    while not hold.with_name("hold.held").exists():
        assert time.monotonic() < deadline, "no new core"
        time.sleep(0.05)
    time.sleep(2 * STALL_TIMEOUT)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "restarting" in health.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert engine.num_restarts == restarts

    hold.unlink()
    wait_for_health(url, 200, 60)
    assert engine.num_restarts == restarts + 1
    got = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                             extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 3
    assert httpx.get(f"{url}/health").status_code == 200
    assert_all_free(server.wait_idle())


def test_a_stuck_core_with_no_request_left_in_flight_is_not_healthy(stuck_server):
    """The client of the request that got the core stuck gives up (its abort queues where the core
    cannot read it): no output is awaited any more, but the probe finds the core stuck."""
    server, _ = stuck_server
    url, engine = server.url, server.async_engine
    wait_for_health(url, 200, 120)
    restarts = engine.num_restarts
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [BLOCK], "max_tokens": 4},
                   timeout=0.5)
    deadline = time.monotonic() + 30
    while engine._tracker.entries:  # the server saw the client leave and aborted its request
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wait_for_health(url, 503, STALL_TIMEOUT + 30)
    wait_for_health(url, 200, 120)  # replaced
    assert engine.num_restarts == restarts + 1


def test_a_stuck_core_with_no_restarts_left_ends_the_engine(odd_checkpoint, embedded_tokenizer, tmp_path):
    with faulty_server(odd_checkpoint, embedded_tokenizer, tmp_path / "hold", max_restarts=0) as server:
        url, engine = server.url, server.async_engine
        reasons = []
        engine.add_dead_hook(reasons.append)  # run_server's stops the server: exit code 1
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [BLOCK], "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 503 and "stalled" in r.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while not reasons:
            assert time.monotonic() < deadline, "the dead hooks did not run"
            time.sleep(0.02)
        assert "stalled" in reasons[0] and "no new core started in 0 tries" in reasons[0]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "not running" in health.json()["error"]["message"]
        assert engine.num_restarts == 0


def test_a_core_on_a_thread_that_stalls_makes_the_server_exit_non_zero(odd_checkpoint, tmp_path):
    """A thread cannot be killed: `pagedserve serve --engine-core thread` whose core is stuck in a step
    fails the request in flight and exits with code 1, for its supervisor to start a new server."""
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from tests.engine.fault_injection import block_steps_on
        from pagedserve.entrypoints.cli import main

        block_steps_on({BLOCK})
        main(sys.argv[1:])
    """))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "log"
    server = subprocess.Popen(
        [sys.executable, str(script), "serve", "--port", str(port), "--model", str(odd_checkpoint[0]),
         "--served-model-name", MODEL, "--engine-core", "thread", "--engine-stall-timeout", str(STALL_TIMEOUT), "--num-kv-blocks", "64",
         "--max-model-len", "256", "--max-num-batched-tokens", "64"],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [BLOCK], "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 503 and "stalled" in r.json()["error"]["message"]
        assert server.wait(timeout=60) == 1, log.read_text()
        assert "error: the engine core could not be restarted: the engine core made no progress" in log.read_text()
    finally:
        server.kill()
        server.wait()


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
