"""The core clients' contract, on a scripted core: commands reach the core in order, each step's
outputs reach the front, a core that can run no more steps (or is stuck in one) is reported lost
and dead, and a client that serves no core refuses requests. (The real core behind each client: test_async_llm*.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pagedserve.core.messages import CoreStats, EngineCoreOutputs, EngineCoreRequest, SampleOutput
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import InprocClient, ThreadedCoreClient
from pagedserve.engine.protocol import EngineUnavailable
from pagedserve.executor.base import ExecutorFailed
from pagedserve.kv import KVCacheStats
from pagedserve.sampling_params import SamplingParams


class ScriptedCore:
    """An engine core's interface: each request runs `steps` steps, one token each; `fail_at` makes
    the n-th step raise ExecutorFailed, `block_at` makes it wait until `unblock` is set."""

    def __init__(self, steps: int = 3, fail_at: int | None = None, block_at: int | None = None) -> None:
        self.log: list[tuple] = []
        self.left: dict[str, int] = {}
        self.steps, self.fail_at, self.block_at, self.num_steps = steps, fail_at, block_at, 0
        self.unblock = threading.Event()
        self.max_model_len, self.vocab_size, self.num_blocks = 64, 100, 8
        self.scheduler = SimpleNamespace(max_num_seqs=4)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.log.append(("add", request.request_id))
        self.left[request.request_id] = self.steps

    def abort_requests(self, request_ids: list[str]) -> None:
        self.log.append(("abort", *request_ids))
        for request_id in request_ids:
            self.left.pop(request_id, None)

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        self.log.append(("stop", *samples))

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[SampleOutput]:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise ExecutorFailed("a worker died")
        if self.num_steps == self.block_at:
            self.unblock.wait()
        outputs = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            outputs.append(SampleOutput(request_id, 0, [7], finish_reason="length" if done else None))
            if done:
                del self.left[request_id]
        return outputs

    def fail_all(self, message: str) -> list[SampleOutput]:
        self.log.append(("fail_all", message))
        failed = [SampleOutput(r, 0, [], finish_reason="error", error=message) for r in self.left]
        self.left.clear()
        return failed

    def core_stats(self) -> CoreStats:
        return CoreStats(0, len(self.left), KVCacheStats(8, 8, 0, 0, 0, 0, 0, 0, 0), 0)

    def kv_view(self) -> None:
        return None  # nobody watches the pool here

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.log.append(("shutdown",))


class Recorder:
    """CoreEvents that keep what they were told."""

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutputs] = []
        self.lost: list[tuple[str, bool]] = []
        self.dead: list[str] = []
        self.changed = threading.Event()

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.outputs.append(outputs)
        self.changed.set()

    def on_core_lost(self, reason: str, restarting: bool) -> None:
        self.lost.append((reason, restarting))

    def on_core_ready(self, ready) -> None:
        raise AssertionError("a thread client never restarts its core")

    def on_dead(self, reason: str) -> None:
        self.dead.append(reason)
        self.changed.set()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=3))


def test_the_thread_client_steps_its_core_while_there_is_work_and_reports_every_step():
    core, events = ScriptedCore(steps=3), Recorder()
    client = ThreadedCoreClient(None, [], core=core)
    client.start(events)
    assert client.ready.max_model_len == 64 and client.ready.max_num_seqs == 4 and client.health_problem() is None
    client.add_request(request("a"))
    wait_for(lambda: not core.has_unfinished_requests() and events.outputs)
    tokens = [o for message in events.outputs for o in message.outputs if o.request_id == "a"]
    assert len(tokens) == 3 and tokens[-1].finish_reason == "length"
    idle_steps = core.num_steps
    time.sleep(0.2)
    assert core.num_steps == idle_steps  # idle: no step runs without work
    client.stop_samples([("a", 0)])
    client.abort_requests(["a"])
    wait_for(lambda: ("abort", "a") in core.log)
    assert core.log.index(("stop", ("a", 0))) < core.log.index(("abort", "a"))  # in the order sent
    client.shutdown()
    assert ("shutdown",) not in core.log  # a core it was given stays its owner's
    with pytest.raises(EngineUnavailable, match="shut down"):
        client.add_request(request("b"))
    client.abort_requests(["b"])  # dropped, no error


def test_a_core_that_can_run_no_more_steps_is_lost_then_dead_and_refuses_requests():
    core, events = ScriptedCore(steps=5, fail_at=2), Recorder()
    client = ThreadedCoreClient(None, [], core=core)
    client.start(events)
    client.add_request(request("a"))
    wait_for(lambda: events.dead)
    assert events.lost == [("a worker died", False)] and events.dead == ["a worker died"]
    assert ("fail_all", "a worker died") in core.log and not core.has_unfinished_requests()  # blocks freed
    assert "a worker died" in client.health_problem()
    with pytest.raises(EngineUnavailable, match="a worker died"):
        client.add_request(request("b"))
    client.shutdown()


def test_a_core_stuck_in_a_step_on_a_thread_is_dead_and_the_client_still_shuts_down():
    """A thread cannot be killed: once a step has run for over the stall timeout the core is lost
    and dead (with or without requests in flight: here the request was aborted while it was stuck),
    and shutdown() returns without waiting for the stuck thread."""
    core, events = ScriptedCore(steps=5, block_at=2), Recorder()
    client = ThreadedCoreClient(None, [], core=core, stall_timeout=0.3)
    client.start(events)
    try:
        client.add_request(request("a"))
        wait_for(lambda: core.num_steps == 2)
        client.abort_requests(["a"])  # queued: the stuck thread cannot read it
        wait_for(lambda: events.dead)
        (reason,) = events.dead
        assert "no progress for 0.3 s" in reason and events.lost == [(reason, False)]
        assert "stalled" in client.health_problem()
        with pytest.raises(EngineUnavailable, match="stalled"):
            client.add_request(request("b"))
        start = time.monotonic()
        client.shutdown()
        assert time.monotonic() - start < 5 and ("fail_all", "the engine is shut down") not in core.log
    finally:
        core.unblock.set()  # the thread, back from its step, ends without reporting
    wait_for(lambda: not client._thread.is_alive())
    assert len(events.outputs) == 1  # only the first step's


def test_a_client_not_started_refuses_requests():
    client = ThreadedCoreClient(None, [], core=ScriptedCore())
    assert client.health_problem() == "the engine is not running"
    with pytest.raises(EngineUnavailable, match="not running"):
        client.add_request(request("a"))


def test_the_inproc_client_runs_each_call_at_once():
    core = ScriptedCore(steps=1)
    client = InprocClient(core)
    client.add_request(request("a"))
    assert [o.finish_reason for o in client.step()] == ["length"]
    client.stop_samples([("a", 0)])
    client.abort_requests(["a"])
    client.shutdown()
    assert core.log == [("add", "a"), ("stop", ("a", 0)), ("abort", "a"), ("shutdown",)]


def test_the_front_refuses_an_unknown_core_kind(embedded_tokenizer):
    with pytest.raises(ValueError, match="engine_core must be 'process' or 'thread'"):
        AsyncLLM(tokenizer=embedded_tokenizer, engine_core="fiber")
