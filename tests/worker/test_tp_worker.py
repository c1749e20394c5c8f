"""Two launches on this machine, each acting as a node, meeting through torch.distributed's env://
rendezvous: the driver (an engine command, RANK=0) and `pagedserve worker` (RANK=1); and the
same with torchrun starting one command on both "nodes"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.executor.tensor_parallel import free_port

pytestmark = pytest.mark.timeout(300)

PAGEDSERVE = str(Path(sys.executable).parent / "pagedserve")
GENERATE = ["generate", "The quick brown fox", "Hello there", "--max-tokens", "12", "--temperature", "0",
            "--num-kv-blocks", "64"]


def node_env(rank: int, port: int) -> dict[str, str]:
    return os.environ | {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def tp1_output(odd_checkpoint) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = finish(subprocess.Popen([PAGEDSERVE, *GENERATE, "--model", str(odd_checkpoint[0])], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert len(out.splitlines()) == 2 and out.strip()  # one completion per prompt
    return out


@pytest.mark.tp
def test_pagedserve_worker_serves_a_driver_started_apart(odd_checkpoint, tp1_output):
    port = free_port()
    driver = subprocess.Popen([PAGEDSERVE, *GENERATE, "--model", str(odd_checkpoint[0]), "--tensor-parallel-size", "2"],
                              env=node_env(0, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = subprocess.Popen([PAGEDSERVE, "worker"], env=node_env(1, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert finish(driver) == tp1_output
    finish(worker)  # exits 0 on the driver's shutdown


@pytest.mark.tp
def test_torchrun_runs_the_same_command_on_two_nodes(odd_checkpoint, tp1_output):
    port = free_port()
    nodes = [subprocess.Popen(
        [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--node-rank", str(rank),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--no-python", PAGEDSERVE, *GENERATE, "--model", str(odd_checkpoint[0]), "--tensor-parallel-size", "2"],
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [finish(node) for node in nodes]
    assert outputs[0] == tp1_output
    assert outputs[1] == ""  # rank 1 served; only the driver prints


def test_pagedserve_worker_without_the_rendezvous_variables_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([PAGEDSERVE, "worker"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in result.stderr
