"""Start an OpenAI-compatible server as a child process for `bench serving --systems`, and stop it.

pagedserve runs as `python -m pagedserve.entrypoints.cli serve` in this Python; vLLM as its own
`vllm.entrypoints.openai.api_server` in the Python given by --vllm-python, bound to every core (its
best setting in `bench throughput`). Each server gets a free loopback port, its log goes to a file,
and it is ready when `/health` answers 200. It runs in its own process group, so stopping it also
stops the engine processes it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

SERVER_SYSTEMS = ("pagedserve", "vllm")


@dataclass
class LaunchedServer:
    system: str
    url: str
    pid: int
    startup_s: float  # from the process start to /health answering 200
    log_path: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, port: int, model_name: str, dtype: str, vllm_python: str | None = None,
                   hf_model_dir: str | None = None, api_key: str | None = None,
                   extra_args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that serve `model_name` on 127.0.0.1:`port`, with
    `extra_args` (the server's own flags) appended."""
    if system == "pagedserve":
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
               "--served-model-name", model_name, "--dtype", dtype]
        env = {}
    elif system == "vllm":
        if not vllm_python or not hf_model_dir:
            raise ValueError("vllm needs --vllm-python (a Python with vllm installed) and --hf-model-dir "
                             "(the model as an HF directory: pagedserve export-hf)")
        # The same KV budget as pagedserve's CPU default (1 GiB) and prefix caching on, as in pagedserve.
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--model", hf_model_dir, "--served-model-name", model_name, "--dtype", dtype, "--seed", "0",
               "--enable-prefix-caching", "--kv-cache-memory-bytes", str(1 << 30)]
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    else:
        raise ValueError(f"unknown server system {system!r}; choose from {', '.join(SERVER_SYSTEMS)}")
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra_args or []), env


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready; "
                               f"its log ends: {tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"the server at {url} was not ready after {timeout_s:.0f} s; its log ends: {tail(log_path)}")


def tail(path: str, lines: int = 5) -> str:
    with open(path, errors="replace") as f:
        return " | ".join(f.read().strip().splitlines()[-lines:])


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT (both servers drain and exit on it), then SIGKILL to the whole group after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # children the server left behind, if any
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def launch(system: str, model_name: str, dtype: str = "float32", vllm_python: str | None = None,
           hf_model_dir: str | None = None, api_key: str | None = None,
           ready_timeout_s: float = 600.0, extra_args: list[str] | None = None) -> Iterator[LaunchedServer]:
    port = free_port()
    cmd, env = server_command(system, port, model_name, dtype, vllm_python, hf_model_dir, api_key, extra_args)
    log_path = os.path.join(tempfile.mkdtemp(prefix="pagedserve-bench-"), f"{system}-server.log")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, ready_timeout_s, log_path)
        yield LaunchedServer(system, url, proc.pid, time.perf_counter() - start, log_path)
    finally:
        stop(proc)
