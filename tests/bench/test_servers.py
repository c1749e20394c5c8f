"""The servers `bench serving --systems` starts: a real `pagedserve serve` child comes up on a free
port and answers, and stopping it leaves no process behind; a server that dies before it is ready,
or a child that ignores SIGINT, is handled without hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from pagedserve.bench.servers import launch, server_command, stop, wait_healthy


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_vllm_needs_its_python_and_an_hf_directory():
    with pytest.raises(ValueError, match="--vllm-python"):
        server_command("vllm", 8000, "m", "float32")
    cmd, env = server_command("vllm", 8001, "m", "bfloat16", vllm_python="/x/python", hf_model_dir="/m")
    assert cmd[:3] == ["/x/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "8001" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    with pytest.raises(ValueError, match="unknown server system 'tgi'"):
        server_command("tgi", 8000, "m", "float32")


@pytest.mark.slow
def test_a_pagedserve_server_starts_answers_and_stops_cleanly():
    with launch("pagedserve", "bench-model", api_key="k") as server:
        models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert [m["id"] for m in models["data"]] == ["bench-model"]
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert 0 < server.startup_s < 120
        url, pid = server.url, server.pid
    assert not alive(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path):
    log = tmp_path / "log"
    log.write_text("loading...\nerror: no such model\n")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match="exited with 3 .*no such model"):
        wait_healthy("http://127.0.0.1:9", proc, 30, str(log))


def test_stop_kills_the_group_when_sigint_is_ignored():
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)']); print(child.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    start = time.monotonic()
    stop(proc, grace_s=0.5)
    assert time.monotonic() - start < 10
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:  # reaped by init once its parent is gone
        time.sleep(0.05)
    assert not alive(child)
