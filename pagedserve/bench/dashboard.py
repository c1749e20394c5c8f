"""`pagedserve bench dashboard`: what live-view viewers cost the rest of the API.

A real server (`pagedserve serve`, a child process on loopback) streams one completion (the
neighbour, restarted whenever it ends) and answers a /health probe every `HEALTH_EVERY` seconds.
First alone ("quiet"), then ("loaded") while a second process runs the dashboard's load: `viewers`
HTTP clients that read /dashboard/events as fast as frames come, `non_readers` connections that ask
for it with a tiny receive buffer and never read, and `churn` clients that connect, ask, and drop,
over and over (the viewers first, then the others). Reported per phase: the neighbour's gaps between
tokens (median, p99, max), /health's latency, the CPU the API process used (of one core) and its RSS,
and what the load saw: viewers served and refused (503), frames per second per served viewer,
non-readers the server closed, churn cycles, and how long after the load the server counted no
viewer (nothing lasting). The load runs in its own process so that its clients' work is not counted
in the neighbour's gaps (it still shares the machine's cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import socket
import statistics
import threading
import time

import httpx

HEALTH_EVERY = 0.1  # seconds between /health probes
TINY_RECEIVE_BUFFER = 4096  # a non-reader's SO_RCVBUF: what the kernel may take for it at the client side


def run_dashboard_bench(viewers: int = 1000, non_readers: int = 300, churn: int = 20,
                        max_viewers: tuple[int | None, ...] = (None,), quiet_s: float = 10.0, loaded_s: float = 40.0,
                        server_args: tuple[str, ...] = ()) -> list[dict]:
    """One row per (server, phase): each `max_viewers` value (None: the server's default) starts its own
    server with `--dashboard-max-viewers` set so."""
    from pagedserve.bench.servers import launch

    rows = []
    for bound in max_viewers:
        extra = list(server_args) + ([] if bound is None else ["--dashboard-max-viewers", str(bound)])
        with launch("pagedserve", "dashboard-bench", extra_args=extra) as server:
            label = "default" if bound is None else str(bound)
            quiet = _measure(server.url, server.pid, quiet_s, load=None)
            rows.append({"max_viewers": label, "phase": "quiet", **quiet})
            load = dict(viewers=viewers, non_readers=non_readers, churn=churn)
            loaded = _measure(server.url, server.pid, loaded_s, load=load)
            rows.append({"max_viewers": label, "phase": "loaded", **load, **loaded})
    return rows


def _measure(url: str, pid: int, seconds: float, load: dict | None) -> dict:
    """The neighbour's gaps and /health's latencies over `seconds` (with `load` running, if given)."""
    stop = threading.Event()
    gaps: list[tuple[float, float]] = []  # (time of the token, seconds since the one before)
    health: list[float] = []
    failures: list[str] = []
    threads = [threading.Thread(target=_neighbour, args=(url, stop, gaps, failures), daemon=True),
               threading.Thread(target=_probe_health, args=(url, stop, health, failures), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the neighbour is streaming before anything is measured
    gaps.clear()
    health.clear()
    seen: dict = {}
    cpu = _cpu_seconds(pid)
    start = time.perf_counter()
    if load is None:
        time.sleep(seconds)
    else:
        seen = _run_load(url, seconds, **load)
    elapsed = time.perf_counter() - start
    used = {name: (_cpu_seconds(pid).get(name, 0.0) - before) / elapsed for name, before in cpu.items()}
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if load is not None:
        seen["viewers_after_s"] = _seconds_until_no_viewers(url)
    longest = max(gaps, key=lambda g: g[1], default=(0.0, 0.0))
    began = seen.pop("load_began", None)
    return {"tokens": len(gaps), **_spread("gap_ms", [g for _, g in gaps]), **_spread("health_ms", health),
            # when the longest gap began, from the load's first connection
            "gap_max_after_load_s": None if began is None else longest[0] - longest[1] - began,
            "api_cpu": used["api"], "core_cpu": used.get("core"), "api_rss_mib": _rss_mib(pid),
            "failures": failures[:5], **seen}


def _seconds_until_no_viewers(url: str, timeout: float = 30.0) -> float | None:
    """Once the load has gone: how long until the server counts no viewer (None: not within `timeout`)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        with contextlib.suppress(httpx.HTTPError):
            for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
                if line.startswith("pagedserve:dashboard_viewers ") and float(line.split()[1]) == 0:
                    return time.perf_counter() - start
        time.sleep(0.2)
    return None


def _spread(name: str, seconds: list[float]) -> dict:
    if not seconds:
        return {f"{name}_median": None, f"{name}_p99": None, f"{name}_max": None}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {f"{name}_median": 1000 * statistics.median(ordered), f"{name}_p99": 1000 * p99,
            f"{name}_max": 1000 * ordered[-1]}


def _cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the API process and its engine-core child have used."""
    def seconds(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    used = {"api": seconds(pid)}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    if children:
        used["core"] = sum(seconds(c) for c in children)
    return used


def _rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def _neighbour(url: str, stop: threading.Event, gaps: list[tuple[float, float]], failures: list[str]) -> None:
    """Streams completions one after another until `stop`, noting the time between tokens."""
    body = {"model": "dashboard-bench", "prompt": "Count slowly from one to a thousand:", "max_tokens": 4000,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            try:
                with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        failures.append(f"neighbour: {response.status_code}")
                        time.sleep(0.5)
                        continue
                    last = None
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.monotonic()  # the load process's clock too
                        if last is not None:
                            gaps.append((now, now - last))
                        last = now
                        if stop.is_set():
                            return
            except httpx.HTTPError as e:
                failures.append(f"neighbour: {e!r}")


def _probe_health(url: str, stop: threading.Event, latencies: list[float], failures: list[str]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.wait(HEALTH_EVERY):
            start = time.perf_counter()
            try:
                status = client.get(f"{url}/health").status_code
            except httpx.HTTPError as e:
                failures.append(f"health: {e!r}")
                continue
            latencies.append(time.perf_counter() - start)
            if status != 200:
                failures.append(f"health: {status}")


# ---- the load, in its own process ------------------------------------------------------------------


def _run_load(url: str, seconds: float, viewers: int, non_readers: int, churn: int) -> dict:
    context = multiprocessing.get_context("spawn")
    receive, give = context.Pipe(duplex=False)
    process = context.Process(target=_load_process, args=(url, seconds, viewers, non_readers, churn, give),
                              daemon=True)
    process.start()
    try:
        if not receive.poll(seconds + 120):
            raise TimeoutError("the dashboard load did not report back")
        return receive.recv()
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def _load_process(url: str, seconds: float, viewers: int, non_readers: int, churn: int, give) -> None:
    give.send(asyncio.run(_load(url, seconds, viewers, non_readers, churn)))


async def _load(url: str, seconds: float, viewers: int, non_readers: int, churn: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    request = (f"GET /dashboard/events HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n\r\n").encode()
    began = time.monotonic()
    deadline = began + seconds
    answered = asyncio.Semaphore(0)  # one release per viewer that has its status line
    watching = [asyncio.create_task(_viewer(host, int(port), request, deadline, answered)) for _ in range(viewers)]
    with contextlib.suppress(asyncio.TimeoutError):  # the viewers are in (or refused) before the attackers come
        await asyncio.wait_for(_acquire(answered, viewers), timeout=seconds / 4)
    silent = [_silent_connection(host, int(port), request) for _ in range(non_readers)]
    churned = await asyncio.gather(*(_churner(host, int(port), request, deadline) for _ in range(churn)))
    viewed = await asyncio.gather(*watching)
    await asyncio.sleep(deadline - time.monotonic())  # the non-readers' whole time, whatever else runs
    served = [frames for status, frames, _ in viewed if status == 200]
    dropped = sum(_was_dropped(s) for s in silent)
    for s in silent:
        s.close()
    return {"served": len(served), "refused": sum(status == 503 for status, _, _ in viewed),
            "other_status": sorted({status for status, _, _ in viewed} - {200, 503}),
            "cut_early": sum(cut for status, _, cut in viewed if status == 200),
            "frames_per_viewer": statistics.median(served) if served else 0,
            "frames_per_viewer_per_s": (statistics.median(served) if served else 0) / seconds,
            "non_readers_dropped": dropped, "churn_cycles": sum(churned), "load_began": began}


async def _acquire(semaphore: asyncio.Semaphore, times: int) -> None:
    for _ in range(times):
        await semaphore.acquire()


async def _viewer(host: str, port: int, request: bytes, deadline: float,
                  answered: asyncio.Semaphore) -> tuple[int, int, bool]:
    """(status, frames read, whether the server ended the stream before the deadline)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        answered.release()
        return 0, 0, False
    try:
        writer.write(request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        finally:
            answered.release()
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            return status, 0, False
        frames, tail = 0, b""
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(1 << 16), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if not chunk:
                return status, frames, True
            text = tail + chunk
            frames += text.count(b"\ndata: {")  # each message follows a chunk's size line or the last message
            tail = text[-7:]
        return status, frames, False
    except (OSError, asyncio.IncompleteReadError, ValueError):
        return 0, 0, True
    finally:
        writer.close()


async def _churner(host: str, port: int, request: bytes, deadline: float) -> int:
    """Connects, asks for the stream and drops the connection, over and over; the cycles done."""
    cycles = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            if cycles % 2:
                await reader.readuntil(b"\r\n\r\n")  # half the drops come after the response began
            writer.close()
        cycles += 1
        await asyncio.sleep(0.05)
    return cycles


def _silent_connection(host: str, port: int, request: bytes) -> socket.socket:
    """A connection that asks for the stream and never reads (a receive buffer as small as the kernel allows)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RECEIVE_BUFFER)
    s.connect((host, port))
    s.sendall(request)
    return s


def _was_dropped(s: socket.socket) -> bool:
    """Whether the server closed or reset this never-read connection."""
    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        return True
    s.setblocking(False)
    try:
        while s.recv(1 << 16):
            pass
        return True  # the end of the stream
    except BlockingIOError:
        return False  # still open, data or not
    except OSError:
        return True


def format_table(rows: list[dict]) -> str:
    def ms(r: dict, name: str) -> str:
        values = (r[f"{name}_{k}"] for k in ("median", "p99", "max"))
        return " / ".join("-" if v is None else f"{v:.0f}" for v in values)

    lines = ["| --dashboard-max-viewers | phase | viewers / non-readers / churn | served / refused "
             "| frames/s per viewer | non-readers closed | no viewer left after (s) "
             "| neighbour gap median / p99 / max (ms) | /health median / p99 / max (ms) | API CPU | API RSS (MiB) |",
             "|---|---|---|---|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        if r["phase"] == "loaded":
            after = "-" if r["viewers_after_s"] is None else f"{r['viewers_after_s']:.1f}"
            load = (f"{r['viewers']} / {r['non_readers']} / {r['churn']} | {r['served']} / {r['refused']} | "
                    f"{r['frames_per_viewer_per_s']:.1f} | {r['non_readers_dropped']} | {after}")
        else:
            load = "- | - | - | - | -"
        lines.append(f"| {r['max_viewers']} | {r['phase']} | {load} | {ms(r, 'gap_ms')} | {ms(r, 'health_ms')} | "
                     f"{r['api_cpu']:.0%} | {r['api_rss_mib']:.0f} |")
    return "\n".join(lines)
