"""A tensor-parallel worker: rank r > 0 of the group, running its share of every forward pass.

A worker joins the group (`join_group`), takes the engine's settings from the driver, loads its
shard of the model, then loops: receive a command (protocol.py), do it, wait for the next. It ends
on the driver's SHUTDOWN, and with an error when the group breaks (the driver died: gloo sees the
connection close at once). A worker that the engine spawned also exits when its parent process
ends, even by SIGKILL (a pipe only the parent holds closes).

Workers on other machines are started with `pagedserve worker` (or by torchrun running the same
engine command on every node): rendezvous through torch.distributed's env:// variables.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pagedserve.distributed.group import TPGroup
from pagedserve.lifetime import exit_with_parent
from pagedserve.worker import tp_protocol as protocol

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # an idle worker waits for the next command this long


def join_group(rank: int, size: int, init_method: str, timeout_s: float, device: str) -> tuple[TPGroup, object]:
    """Rendezvous; return (this rank's compute group, the control group). The default group does
    the compute collectives (gloo on CPU, NCCL on CUDA) and may wait `timeout_s` in any of them;
    the control group (gloo) carries commands and may idle."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD), control


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: str, local_rank: int) -> str:
    """Each rank's device: cuda:<local rank> on CUDA (one GPU per process), else the same."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def serve(rank: int, size: int, init_method: str, timeout_s: float, local_rank: int = 0,
          device: str = "cpu") -> None:
    """Run rank `rank` until the driver shuts the group down."""
    tp, control = join_group(rank, size, init_method, timeout_s, device)
    try:
        config = [None]
        dist.broadcast_object_list(config, src=0, group=control)  # once, at start: the engine's settings
        try:
            runner = load_shard(config[0], tp, control, local_rank)
        except Exception:
            return  # the driver reports which rank failed, and why
        _loop(runner, control)
    finally:
        leave_group()


def load_shard(config, tp: TPGroup, control, local_rank: int = 0):
    """Every rank at once: build this rank's model runner over its shard, then learn whether all
    ranks did. Raises this rank's own error, or RuntimeError naming another rank's."""
    error = None
    try:
        runner = build_runner(config, tp, local_rank)
    except Exception as e:
        logger.exception("rank %d could not load its shard", tp.rank)
        error = e
    errors = [None] * tp.size
    dist.all_gather_object(errors, None if error is None else f"rank {tp.rank} could not load its shard of the "
                           f"model: {error!r}", group=control)
    if error is not None:
        raise error
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))
    return runner


def build_runner(config, tp: TPGroup, local_rank: int):
    """This rank's model runner over its shard (the driver builds its own the same way)."""
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.models.loader import load_model

    config = dataclasses.replace(config, device=rank_device(config.device, local_rank))
    model, model_config = load_model(config.model, config.torch_dtype, config.device, tp, config.quantization)
    return ModelRunner(model, model_config, config)


def _loop(runner, control) -> None:
    head = torch.empty(protocol.HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(head, src=0, group=control)
        op = int(head[0])
        if op == protocol.SHUTDOWN:
            return
        if op == protocol.STEP:
            payload = torch.empty(protocol.payload_len(head, runner.kv_layout.num_groups), dtype=torch.int64)
            dist.broadcast(payload, src=0, group=control)
            try:
                runner.run(protocol.unpack_step(head, payload, runner.kv_layout.num_groups))
            except Exception:
                # The driver hit the same error at the same point (the pass is the same code on
                # every rank) and contains it; if not, its next collective times out.
                logger.exception("rank %d: a step failed", dist.get_rank())
        elif op == protocol.MEASURE_KV:
            budget = torch.tensor([runner.measure_kv_budget(int(head[1]))], dtype=torch.int64)
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=control)
        elif op == protocol.INIT_KV:
            runner.allocate_kv_cache(int(head[1]))
        elif op == protocol.WARM_UP:
            runner.warm_up(int(head[1]), int(head[2]))


def run_spawned(rank: int, size: int, init_method: str, timeout_s: float, threads: int, device: str,
                parent_alive: Connection, ready: Connection, log_level: int) -> None:
    """Entry point of a worker process that the engine spawned on this machine. It says `ready`
    once started, just before it joins the group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine, which shuts us down
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s pagedserve.rank{rank}: %(message)s")
    exit_with_parent(parent_alive)
    torch.set_num_threads(threads)
    ready.send(True)
    ready.close()
    try:
        serve(rank, size, init_method, timeout_s, local_rank=rank, device=device)
    except Exception as e:
        logger.error("rank %d stops: %r", rank, e)
        raise SystemExit(1) from None


def run_from_env(timeout_s: float) -> None:
    """`pagedserve worker`: join the group that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT name
    (torch.distributed's env:// rendezvous) and serve until the driver shuts it down."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise SystemExit(f"pagedserve worker: set {', '.join(missing)} (torch.distributed's env:// rendezvous; "
                         "the driver is RANK=0, started with --tensor-parallel-size WORLD_SIZE)")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        raise SystemExit("pagedserve worker: RANK=0 is the driver; start it with an engine command "
                         "(serve, generate, ...) and --tensor-parallel-size WORLD_SIZE")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    serve(rank, size, "env://", timeout_s, int(os.environ.get("LOCAL_RANK", "0")), device)

