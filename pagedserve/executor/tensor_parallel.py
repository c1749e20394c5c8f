"""The tensor-parallel executor: the driver (rank 0, in the engine's process) and N-1 workers.

The engine core plans and samples once, on the driver; the driver holds the block tables. Each
step the driver turns the plan into flat arrays (`ModelRunner.prepare`), broadcasts them to the
workers (protocol.py: two broadcasts), and every rank runs its shard of the forward pass; the
layers all-reduce their partial sums, and rank 0 gathers the vocabulary slices of the logits.

Workers are spawned on this machine (distributed_executor_backend="mp"), or were started
elsewhere and meet the driver through env:// ("external": `pagedserve worker`, or torchrun
running the same command on every node). A worker that dies or a collective that times out
breaks the group for good: the step raises ExecutorFailed, the remaining workers are stopped,
and the engine fails every request (it does not try to contain such a fault).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.executor.base import ExecutorFailed
from pagedserve.worker import tp_protocol as protocol
from pagedserve.worker.draft_runner import make_draft_runner
from pagedserve.worker.model_runner import StepInputs
from pagedserve.worker.tp_worker import join_group, leave_group, load_shard, run_spawned

logger = logging.getLogger(__name__)

WORKER_EXIT_GRACE = 10.0  # seconds a worker may take to exit after SHUTDOWN before it is killed
# Seconds a spawned worker may take to start (a fresh interpreter importing torch) before it is
# ready to join the group. Not the collective timeout: a busy machine can take far longer to
# start a process than a healthy group takes to answer a collective.
WORKER_START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.models.loader import load_config
        from pagedserve.models.sharding import check_tp_size

        size = config.tensor_parallel_size
        check_tp_size(load_config(config.model), size)  # before any process starts
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group (another tensor-parallel "
                               "engine?); shut that engine down first")
        self.size = size
        self.broadcast_seconds = 0.0  # time spent sending steps to the workers (bench profile)
        self.num_steps = 0
        self._failed: str | None = None
        self._timeout = datetime.timedelta(seconds=config.distributed_timeout)
        self._processes: list[mp.Process] = []
        self._parent_ends: list = []
        self._threads_before = torch.get_num_threads()
        if config.distributed_executor_backend == "external":
            self.init_method = init_method = "env://"
            _check_driver_env(size)
        else:
            self.init_method = init_method = f"tcp://127.0.0.1:{free_port()}"
            torch.set_num_threads(max(1, self._threads_before // size))  # the same cores, shared by N ranks
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._parent_ends, self._threads_before)
        try:
            if config.distributed_executor_backend != "external":
                self._spawn(config, init_method)
            self.tp, self.control = join_group(0, size, init_method, config.distributed_timeout, config.device)
            dist.broadcast_object_list([config], src=0, group=self.control)  # once: the engine's settings
            self.runner = load_shard(config, self.tp, self.control)
        except BaseException:
            self.shutdown(notify=False)
            raise
        self.model_config = self.runner.model_config
        self.draft = make_draft_runner(config, self.model_config)  # whole, here: the ranks only verify

    def _spawn(self, config: EngineConfig, init_method: str) -> None:
        """Start the workers and wait until each is about to join the group: one that dies while
        starting is an error now, not a rendezvous waiting out its timeout."""
        ctx = mp.get_context("spawn")  # a clean interpreter: no forked threads or CUDA state
        threads = torch.get_num_threads()
        starting = []
        for rank in range(1, self.size):
            child_end, parent_end = ctx.Pipe(duplex=False)
            ready_end, ready_child_end = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=run_spawned, name=f"pagedserve-tp{rank}", daemon=True,
                args=(rank, self.size, init_method, config.distributed_timeout, threads, config.device, child_end,
                      ready_child_end, logging.getLogger().getEffectiveLevel()))
            process.start()
            child_end.close()
            ready_child_end.close()
            self._processes.append(process)
            self._parent_ends.append(parent_end)  # held open: its closing tells the worker we are gone
            starting.append((rank, process, ready_end))
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        for rank, process, ready_end in starting:
            with ready_end:
                wait([ready_end, process.sentinel], timeout=max(0.0, deadline - time.monotonic()))
                if not _said_ready(ready_end):
                    process.join(5)  # its pipe closes a moment before it can be reaped
                    state = (f"exited with code {process.exitcode} while starting" if not process.is_alive()
                             else f"was not ready within {WORKER_START_TIMEOUT:.0f} s")
                    raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {process.pid}) {state}")

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes this executor spawned (none with external workers)."""
        return [p.pid for p in self._processes]

    # ---- the Executor interface ------------------------------------------------------------

    def measure_kv_budget(self, max_model_len: int) -> int:
        """The smallest budget any rank measured (CUDA): every rank allocates the same pool."""
        with self._collectives():
            self._broadcast(protocol.header(protocol.MEASURE_KV, max_model_len))
            budget = torch.tensor([self.runner.measure_kv_budget(max_model_len)], dtype=torch.int64)
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=self.control)
        return int(budget)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        # No CUDA graphs: a captured step would have to capture the collectives too.
        with self._collectives():
            self._broadcast(protocol.header(protocol.INIT_KV, num_blocks))
            self.runner.allocate_kv_cache(num_blocks)
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks, max_model_len)

    def execute(self, step: SchedulerOutput, sample_rows: list[int],
                prompt_spans: list[tuple[int, int, int]]) -> torch.Tensor:
        if self.draft is not None:
            self.draft.fill(step)
        return self._run(self.runner.prepare(step, sample_rows, prompt_spans))

    def warm_up(self, num_tokens: int, max_model_len: int) -> None:
        with self._collectives():  # each rank makes the same dummy step itself
            self._broadcast(protocol.header(protocol.WARM_UP, num_tokens, max_model_len))
            self.runner.warm_up(num_tokens, max_model_len)

    def _run(self, inputs: StepInputs) -> torch.Tensor:
        """Send every rank the step's inputs, and run this rank's share of it."""
        with self._collectives():
            start = time.perf_counter()
            head, payload = protocol.pack_step(inputs)
            self._broadcast(head)
            self._broadcast(payload)
            self.broadcast_seconds += time.perf_counter() - start
            self.num_steps += 1
            return self.runner.run(inputs)

    def fast_paths(self) -> dict[str, str | None]:
        return self.runner.fast_paths  # every rank runs the same code on its shard

    def draft_proposer(self):
        return self.draft

    def kv_tier(self):
        return None  # EngineConfig refuses kv_offload_dir under tensor parallelism

    def transfer_blocks(self, stores, loads) -> None:
        raise NotImplementedError("the KV tier is not supported under tensor parallelism")

    def prefetch_lora(self, adapter):
        # The driver reads its shard off the step loop; each worker reads its own when a step first
        # needs the adapter (tp_protocol carries the (slot, adapter) loads with the step).
        return self.runner.lora.prefetch(adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.lora.remove(lora_int_id)

    def check_health(self) -> None:
        """ExecutorFailed if the group is broken, or a spawned worker is gone."""
        if self._failed is None:
            dead = self._dead_workers()
            if dead:
                self._fail(dead)
        if self._failed is not None:
            raise ExecutorFailed(self._failed)

    def shutdown(self, notify: bool = True) -> None:
        """Tell the workers to exit (unless the group is broken), wait for them, leave the group."""
        if notify and self._failed is None and dist.is_initialized():
            try:
                self._broadcast(protocol.header(protocol.SHUTDOWN))
            except Exception as e:
                logger.warning("could not tell the workers to stop (%r); stopping them", e)
        if getattr(self, "runner", None) is not None and self.runner.lora is not None:
            self.runner.lora.shutdown()
        self._finalizer()
        leave_group()
        # The groups hold the rendezvous store, whose server socket stays bound while they live.
        if hasattr(self, "tp"):
            self.tp.group = self.control = None

    # ---- faults --------------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast from this rank within the group's timeout. gloo bounds a wait to receive but
        not a send: a frozen worker that stops reading left a plain broadcast blocked for good
        once its socket's buffer was full (seen in tests/executor/test_faults.py)."""
        work = dist.broadcast(tensor, src=0, group=self.control, async_op=True)
        try:
            work.wait(self._timeout)
        except RuntimeError as error:
            raise dist.DistError(f"Timed out or failed broadcasting to the workers ({error})") from error

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """Around every exchange with the workers: refuse to start on a broken group, and turn an
        error that breaks the group into ExecutorFailed. Other errors (a bad step, which every rank
        hits alike) pass through for the engine to contain."""
        self.check_health()
        try:
            yield
        except ExecutorFailed:
            raise
        except Exception as error:
            dead = self._dead_workers()
            if dead or isinstance(error, dist.DistError) or any(
                    s in str(error) for s in ("gloo", "NCCL", "Connection closed", "Timed out")):
                raise self._fail(dead or self._dead_workers(wait=1.0) or repr(error)) from error
            raise

    def _dead_workers(self, wait: float = 0.0) -> str:
        """The workers that have exited, said in words; with `wait`, up to that many seconds for one
        to be seen dead (a killed worker's socket can close before its exit is visible)."""
        deadline = time.monotonic() + wait
        while True:
            dead = "; ".join(f"worker rank {i + 1} (pid {p.pid}) exited with code {p.exitcode}"
                             for i, p in enumerate(self._processes) if not p.is_alive())
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _fail(self, reason: str) -> ExecutorFailed:
        """Mark the group broken, stop what is left of it, and return the error to raise."""
        if self._failed is None:
            self._failed = f"the tensor-parallel group of {self.size} ranks broke: {reason}"
            logger.error("%s; stopping the workers", self._failed)
            for process in self._processes:  # no use waiting: they cannot hear a SHUTDOWN now
                process.kill()
            self.shutdown(notify=False)
        return ExecutorFailed(self._failed)


def _said_ready(ready_end) -> bool:
    """Whether a worker's ready message arrived (a pipe closed by its death polls readable too)."""
    try:
        return ready_end.poll() and ready_end.recv()
    except (EOFError, OSError):
        return False


def _check_driver_env(size: int) -> None:
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("distributed_executor_backend='external' needs RANK, WORLD_SIZE, MASTER_ADDR and "
                         "MASTER_PORT in the environment (torch.distributed's env:// rendezvous)")
    if int(world) != size:
        raise ValueError(f"WORLD_SIZE={world} but tensor_parallel_size={size}: one rank per shard")
    if int(rank) != 0:
        raise ValueError(f"RANK={rank}: the engine is the driver, rank 0; start other ranks with `pagedserve worker`")


def _stop(processes: list, parent_ends: list, threads_before: int) -> None:
    """Stop the workers: close their lifelines (a worker whose parent's pipe closes exits, so this
    also ends workers that were never told SHUTDOWN, as at garbage collection or exit), wait for
    them, and kill any that hang on. Then leave the group: torch.distributed keeps this process's
    one group until it is destroyed, so an engine collected without `shutdown` would otherwise bar
    every later tensor-parallel engine of the process."""
    for end in parent_ends:
        end.close()
    deadline = time.monotonic() + WORKER_EXIT_GRACE
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    torch.set_num_threads(threads_before)
    leave_group()
