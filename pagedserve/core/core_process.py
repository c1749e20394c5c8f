"""The engine core in a process of its own: a busy loop between two ZMQ sockets.

The front's `core_client.ProcessCoreClient` binds a PUSH socket for commands and a PULL socket for
outputs; this process connects to both. It applies every command that arrived since its last
step, runs one step, and sends the step's sample outputs with the core's figures, as msgpack
frames (`core_messages`). With nothing to do it blocks on the command socket. Every pass that had
a command or a step sends an outputs message, which is how it answers the front's liveness probe
(`Ping`): a pass that never ends (a step stuck for good) leaves the probe unanswered.

It never outlives the API process: a thread waits on a pipe whose other end only the API process
holds, and exits this process when the pipe closes (the API process ended, even by SIGKILL).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from multiprocessing.connection import Connection

import msgspec
import zmq

from pagedserve import heap
from pagedserve.config import EngineConfig
from pagedserve.core.messages import (AbortRequests, CoreCommand, CoreFailed, CoreReady, EngineCoreOutputs,
                                      EngineCoreRequest, RemoveLoRA, SampleOutput, Shutdown, StopSamples, WatchKV)
from pagedserve.executor.base import HEALTH_CHECK_INTERVAL, ExecutorFailed
from pagedserve.lifetime import exit_with_parent

logger = logging.getLogger(__name__)


def run_engine_core(config: EngineConfig, eos_token_ids: list[int], command_address: str, output_address: str,
                    parent_alive: Connection, log_level: int = logging.INFO) -> None:
    """The core process's main function (a multiprocessing target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API process, which stops us
    # Started as a daemon (its parent ends it at exit), but it may start tensor-parallel workers,
    # which multiprocessing refuses to a daemon; they end with this process (worker.py).
    multiprocessing.current_process().daemon = False
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s pagedserve.core: %(message)s")
    exit_with_parent(parent_alive)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(command_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        from pagedserve.core.engine_core import EngineCore

        core = EngineCore(config, eos_token_ids=eos_token_ids)
        core.warm_up()  # before ready: the first burst should not pay for the first full-budget step
    except BaseException as e:
        logger.exception("the engine core failed to start")
        outputs.send(encoder.encode(CoreFailed(f"the engine core failed to start: {e!r}")))
        outputs.close(linger=1000)
        raise SystemExit(1) from None
    logger.info("froze %d startup objects out of the cycle collector", heap.freeze_startup_objects())
    outputs.send(encoder.encode(ready_message(core)))
    core.structured_output.preload()  # this process has no tokenizer: load its vocabulary while idle
    try:
        _busy_loop(core, commands, outputs, encoder)
    except ExecutorFailed as e:
        outputs.send(encoder.encode(CoreFailed(str(e))))
        raise SystemExit(1) from None
    except BaseException as e:
        logger.exception("the engine core failed")
        outputs.send(encoder.encode(CoreFailed(f"the engine core failed: {e!r}")))
        raise SystemExit(1) from None
    finally:
        core.shutdown()
        outputs.close(linger=1000)
        commands.close(linger=0)
        context.term()


def _busy_loop(core, commands: zmq.Socket, outputs: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> None:
    decoder = msgspec.msgpack.Decoder(CoreCommand)
    while True:
        frames = []
        while not core.has_unfinished_requests() and not frames:  # idle: block, looking at the workers now and then
            if commands.poll(HEALTH_CHECK_INTERVAL * 1000):
                frames.append(commands.recv())
            else:
                core.check_health()  # ExecutorFailed ends this process: the front fails what it holds
        while True:
            try:
                frames.append(commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        results: list[SampleOutput] = []
        for frame in frames:
            command = decoder.decode(frame)
            if isinstance(command, Shutdown):
                return
            results += apply_command(core, command)
        if core.has_unfinished_requests():
            results += step_contained(core)
        outputs.send(encoder.encode(EngineCoreOutputs(results, core.core_stats(), core.kv_view())))


def ready_message(core) -> CoreReady:
    """The facts a started core tells its front."""
    return CoreReady(core.max_model_len, core.vocab_size, core.scheduler.max_num_seqs, core.num_blocks,
                     core.core_stats())


def apply_command(core, command: CoreCommand) -> list[SampleOutput]:
    """Apply a request, abort, stop, adapter removal or watch to the core: the error output of a request it
    failed to add. A Ping needs nothing: the pass's outputs message answers it."""
    if isinstance(command, EngineCoreRequest):
        try:
            core.add_request(command)
        except Exception as e:  # the front validated it: this is the server's fault, not the client's
            logger.exception("adding request %s failed", command.request_id)
            return [SampleOutput(command.request_id, 0, [], finish_reason="error",
                                 error=f"the engine failed to add the request: {e!r}")]
    elif isinstance(command, AbortRequests):
        core.abort_requests(command.request_ids)
    elif isinstance(command, StopSamples):
        core.stop_samples(command.samples)
    elif isinstance(command, RemoveLoRA):
        core.remove_lora(command.lora_int_id)
    elif isinstance(command, WatchKV):
        core.watch_kv(command.seconds)
    return []


def step_contained(core) -> list[SampleOutput]:
    """One core step. A fault the core could not pin on one request fails every request in flight
    (their error outputs), and the core keeps serving; ExecutorFailed (no step can run) propagates."""
    try:
        return core.step()
    except ExecutorFailed:
        raise  # no step can run any more
    except Exception as e:
        # The core could not pin the fault on a request (it fails those itself): fail what is in
        # flight, free its blocks, keep serving.
        logger.exception("engine step failed; failing every request in flight")
        return core.fail_all(f"the engine failed while running this request: {e!r}")
