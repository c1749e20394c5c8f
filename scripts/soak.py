"""A soak of `pagedserve serve` under mixed traffic while attacks are fired at it.

A real server (a process of its own, its engine core in another) serves the embedded model with
LoRA adapters, runtime adapter loading, the KV file tier and an API key. For `--duration` seconds:
- traffic: chat and completions, streamed and not, tool calls, json_schema, n > 1, the adapters,
  prompts sharing a long system prompt (so the prefix cache and the tier are used);
- a neighbour: one streaming request after another, whose gaps between tokens are recorded;
- `--viewers` dashboard readers on /dashboard/events, and /health probed every second;
- every `--attack-every` seconds one attack, in turn: a FIFO in the tier's directory, adapters that
  are huge, damaged, unreadable or not finite, a flood of dashboard connections that never read or
  drop, three 1,000-property schemas at once, two api_key parameters, a Responses follow-up missing
  a function_call_output.
The resident memory of the server and of its core is sampled throughout.

It passes when: no response but the attacks' own is a 5xx; neither process exits or is replaced;
the neighbour never waits over `--max-gap` s between two tokens; every KV block is free at the end;
each process's RSS in the last quarter is within `--rss-tolerance` of the second quarter's. Prints
a report (and writes it as JSON with --json); exits 1 if any check fails.

    python scripts/soak.py --duration 600 --attack-every 30 --viewers 50 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedserve.bench.lora import write_random_adapter
from pagedserve.bench.servers import launch
from pagedserve.models.loader import load_config

API_KEY = "soak-key"
MODEL = "soak"
ADAPTERS = ("soak-a", "soak-b")
SYSTEM_PROMPT = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the port "
                 "and the vessel when you know them, and never invent tracking numbers. " * 6)
QUESTIONS = ["Where is my parcel?", "What is a bill of lading?", "Name three ports in Europe.",
             "How heavy can one container be?", "What does FOB mean?", "Which ocean is the largest?"]
TOOLS = [{"type": "function", "function": {
    "name": "track", "description": "Track a parcel by its number",
    "parameters": {"type": "object", "properties": {"number": {"type": "string"}}, "required": ["number"]}}}]
# Unique prompts that push a prompt's blocks out of the pool (--num-kv-blocks 512, ~25 blocks each).
EVICTING_PROMPTS = 24
SMALL_SCHEMA = {"type": "object", "properties": {"port": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["port", "days"]}


@dataclass
class Report:
    statuses: Counter = field(default_factory=Counter)  # traffic's (kind, status)
    traffic_5xx: list = field(default_factory=list)  # (time, kind, status, body)
    traffic_errors: list = field(default_factory=list)  # transport errors: (time, kind, error)
    attacks: list = field(default_factory=list)  # (time, name, [statuses or errors])
    gaps: list = field(default_factory=list)  # the neighbour's gaps between tokens, s
    worst_gaps: list = field(default_factory=list)  # (gap, time since start)
    health: list = field(default_factory=list)  # (time, status, latency)
    rss: dict = field(default_factory=lambda: defaultdict(list))  # role -> [(time, bytes)]
    viewer_frames: int = 0
    viewer_errors: Counter = field(default_factory=Counter)


# ---- traffic -------------------------------------------------------------------------------

def _chat_body(kind: str, rng: random.Random) -> tuple[str, dict]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": rng.choice(QUESTIONS)}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0.7, "seed": rng.randrange(1000)}
    if kind == "chat_stream":
        body["stream"] = True
    elif kind == "tools":
        body.update(tools=TOOLS, tool_choice="required")
    elif kind == "json_schema":
        body.update(response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SMALL_SCHEMA}},
                    max_tokens=40)
    elif kind == "n2":
        body["n"] = 2
    elif kind == "lora":
        body["model"] = rng.choice(ADAPTERS)
    elif kind == "completion":
        return "/v1/completions", {"model": MODEL, "prompt": SYSTEM_PROMPT + rng.choice(QUESTIONS), "max_tokens": 16}
    return "/v1/chat/completions", body


TRAFFIC_KINDS = ("chat", "chat_stream", "tools", "json_schema", "n2", "lora", "completion")


async def traffic_worker(client: httpx.AsyncClient, report: Report, stop: asyncio.Event, seed: int,
                         start: float) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        kind = rng.choice(TRAFFIC_KINDS)
        path, body = _chat_body(kind, rng)
        try:
            if body.get("stream"):
                async with client.stream("POST", path, json=body) as response:
                    status = response.status_code
                    text = (await response.aread()).decode(errors="replace")
            else:
                response = await client.post(path, json=body)
                status, text = response.status_code, response.text
        except httpx.HTTPError as e:
            report.traffic_errors.append((round(time.monotonic() - start, 1), kind, repr(e)))
            await asyncio.sleep(0.5)
            continue
        report.statuses[(kind, status)] += 1
        if status >= 500 or (body.get("stream") and '"error"' in text):
            report.traffic_5xx.append((round(time.monotonic() - start, 1), kind, status, text[:300]))


async def neighbour(client: httpx.AsyncClient, report: Report, stop: asyncio.Event, start: float) -> None:
    """One streaming request after another; the gaps between its tokens (not its first token's wait)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "stream": True, "temperature": 0.8}
    while not stop.is_set():
        last = None
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    report.statuses[("neighbour", response.status_code)] += 1
                    if response.status_code >= 500:
                        report.traffic_5xx.append((round(time.monotonic() - start, 1), "neighbour",
                                                   response.status_code, (await response.aread()).decode()[:300]))
                    await asyncio.sleep(0.5)
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    if '"error"' in line:
                        report.traffic_5xx.append((round(now - start, 1), "neighbour", 200, line[:300]))
                    if last is not None:
                        gap = now - last
                        report.gaps.append(gap)
                        report.worst_gaps.append((gap, round(now - start, 1)))
                        report.worst_gaps.sort(reverse=True)
                        del report.worst_gaps[5:]
                    last = now
            report.statuses[("neighbour", 200)] += 1
        except httpx.HTTPError as e:
            report.traffic_errors.append((round(time.monotonic() - start, 1), "neighbour", repr(e)))
            await asyncio.sleep(0.5)


async def viewer(client: httpx.AsyncClient, report: Report, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with client.stream("GET", f"/dashboard/events?api_key={API_KEY}") as response:
                if response.status_code != 200:
                    report.viewer_errors[response.status_code] += 1
                    await asyncio.sleep(1.0)
                    continue
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        report.viewer_frames += 1
                    if stop.is_set():
                        return
        except httpx.HTTPError as e:
            report.viewer_errors[type(e).__name__] += 1
            await asyncio.sleep(1.0)


async def health_probe(client: httpx.AsyncClient, report: Report, stop: asyncio.Event, start: float) -> None:
    while not stop.is_set():
        t = time.monotonic()
        try:
            status = (await client.get("/health", timeout=30)).status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        report.health.append((round(t - start, 1), status, time.monotonic() - t))
        await asyncio.sleep(1.0)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _core_pid(server_pid: int) -> int | None:
    """The engine core: the server's child process with the largest RSS (the model's weights)."""
    children = [(c, _rss(c) or 0) for c in _children(server_pid)]
    return max(children, key=lambda c: c[1])[0] if children else None


async def rss_sampler(pids: dict[str, int | None], report: Report, stop: asyncio.Event, start: float) -> None:
    while not stop.is_set():
        for role, pid in pids.items():
            rss = _rss(pid) if pid else None
            if rss is not None:
                report.rss[role].append((round(time.monotonic() - start, 1), rss))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 5.0)


# ---- attacks -------------------------------------------------------------------------------

class Attacks:
    """Each attack returns what it got (statuses or errors); its own failures are allowed."""

    def __init__(self, url: str, client: httpx.AsyncClient, keyless: httpx.AsyncClient, work: Path, tier_dir: Path,
                 model_config) -> None:
        self.url, self.client, self.keyless, self.work, self.tier_dir = url, client, keyless, work, tier_dir
        self.model_config = model_config
        self.count = 0

    def all(self):
        return [self.tier_fifo, self.adapter_huge_config, self.adapter_huge_header, self.adapter_many_files,
                self.adapter_proc_symlink, self.adapter_long_path, self.adapter_not_finite, self.dashboard_flood,
                self.big_schemas, self.double_api_key, self.responses_missing_output]

    async def _load(self, path: str) -> int:
        self.count += 1
        response = await self.client.post("/v1/load_lora_adapter",
                                          json={"lora_name": f"attack-{self.count}", "lora_path": path})
        return response.status_code

    async def tier_fifo(self) -> list:
        """A prompt's blocks written to the tier, their files replaced by named pipes, the blocks pushed
        out of the pool by other prompts, then the prompt again: its read meets the pipes."""
        rng = random.Random(self.count)
        before = set(self.tier_dir.rglob("*.kvblock"))
        prompt = " ".join(rng.choice(QUESTIONS) for _ in range(40))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        got = [(await self.client.post("/v1/completions", json=body)).status_code]
        await asyncio.sleep(1.0)  # the tier's writer thread writes the blocks
        victims = set(self.tier_dir.rglob("*.kvblock")) - before
        for victim in victims:
            with contextlib.suppress(OSError):
                victim.unlink()
                os.mkfifo(victim)
        for k in range(EVICTING_PROMPTS):  # unique prompts: the pool evicts the oldest cached blocks
            filler = {"model": MODEL, "prompt": f"{k} {self.count} " + " ".join(rng.choice(QUESTIONS) for _ in range(60)),
                      "max_tokens": 1}
            got.append((await self.client.post("/v1/completions", json=filler)).status_code)
        got.append((await self.client.post("/v1/completions", json=body)).status_code)
        return [f"{len(victims)} files made pipes", *sorted(Counter(s for s in got if isinstance(s, int)).items())]

    def prepare(self) -> None:
        """The bad adapters, made once before the traffic starts (100k files take a while)."""
        from safetensors.torch import load_file, save_file

        huge_config = self.work / "huge-config"
        huge_config.mkdir()
        with open(huge_config / "adapter_config.json", "wb") as f:
            f.write(b'{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "pad": "')
            f.truncate(2 << 30)  # sparse: 2 GB that take no disk
        (huge_config / "adapter_model.safetensors").write_bytes(b"")

        huge_header = Path(write_random_adapter(str(self.work / "huge-header"), self.model_config, rank=4, seed=1))
        entries = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for i in range(400_000)}
        header = json.dumps(entries).encode()
        with open(huge_header / "adapter_model.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")

        many_files = Path(write_random_adapter(str(self.work / "many-files"), self.model_config, rank=4, seed=2))
        for i in range(100_000):
            (many_files / f"f{i}").touch()

        proc_symlink = Path(write_random_adapter(str(self.work / "proc-symlink"), self.model_config, rank=4, seed=3))
        os.unlink(proc_symlink / "adapter_model.safetensors")
        os.symlink("/proc/self/environ", proc_symlink / "adapter_model.safetensors")

        not_finite = Path(write_random_adapter(str(self.work / "not-finite"), self.model_config, rank=4, seed=4))
        tensors = load_file(not_finite / "adapter_model.safetensors")
        tensors[sorted(tensors)[0]][0, 0] = float("nan")
        save_file(tensors, not_finite / "adapter_model.safetensors")

    async def adapter_huge_config(self) -> list:
        return [await self._load(str(self.work / "huge-config"))]

    async def adapter_huge_header(self) -> list:
        return [await self._load(str(self.work / "huge-header"))]

    async def adapter_many_files(self) -> list:
        """An adapter directory holding 100k other files: nothing lists it, so it loads (200)."""
        status = await self._load(str(self.work / "many-files"))
        if status == 200:
            await self.client.post("/v1/unload_lora_adapter", json={"lora_name": f"attack-{self.count}"})
        return [status]

    async def adapter_proc_symlink(self) -> list:
        return [await self._load(str(self.work / "proc-symlink"))]

    async def adapter_long_path(self) -> list:
        return [await self._load("/tmp/" + "x" * 5000)]

    async def adapter_not_finite(self) -> list:
        return [await self._load(str(self.work / "not-finite"))]

    async def dashboard_flood(self) -> list:
        """300 connections that ask for the stream and never read, 20 that connect and drop, for 20 s."""
        host, port = self.url.removeprefix("http://").split(":")
        request = (f"GET /dashboard/events?api_key={API_KEY} HTTP/1.1\r\nHost: {host}\r\n\r\n").encode()
        silent = []
        for _ in range(300):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            with contextlib.suppress(OSError):
                s.connect((host, int(port)))
                s.sendall(request)
            silent.append(s)
        deadline = time.monotonic() + 20
        dropped = 0
        while time.monotonic() < deadline:
            for _ in range(20):
                with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=2) as s:
                    s.sendall(request)
                    dropped += 1
            await asyncio.sleep(2.0)
        for s in silent:
            s.close()
        return [f"300 silent, {dropped} dropped"]

    async def big_schemas(self) -> list:
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(1000)}}

        async def one(i: int) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Fill the form {self.count}-{i}."}],
                    "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
                        "name": "form", "schema": {**schema, "title": f"form-{self.count}-{i}"}}}}
            response = await self.client.post("/v1/chat/completions", json=body, timeout=300)
            if response.status_code == 200:
                return 200
            return f"{response.status_code}: {response.json().get('error', {}).get('message', '')[:160]}"

        return list(await asyncio.gather(*(one(i) for i in range(3))))

    async def double_api_key(self) -> list:
        response = await self.keyless.get(f"/dashboard/events?api_key={API_KEY}&api_key={API_KEY}", timeout=5)
        return [response.status_code]

    async def responses_missing_output(self) -> list:
        calls = [{"type": "function_call", "call_id": f"call_{k}", "name": "track",
                  "arguments": json.dumps({"number": str(k)})} for k in range(2)]
        body = {"model": MODEL, "tools": [{"type": "function", **TOOLS[0]["function"]}], "max_output_tokens": 16,
                "input": [{"role": "user", "content": "Track parcels 0 and 1."}, *calls,
                          {"type": "function_call_output", "call_id": "call_0", "output": "in Rotterdam"}]}
        return [(await self.client.post("/v1/responses", json=body)).status_code]


# ---- the run -------------------------------------------------------------------------------

def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _status(item) -> int:
    """The HTTP status an attack's result item names (0 when it names none)."""
    if isinstance(item, tuple):
        item = item[0]
    if isinstance(item, int):
        return item
    head = str(item).split(":")[0]
    return int(head) if head.isdigit() else 0


def _quarter_median(samples: list[tuple[float, int]], duration: float, quarter: int) -> float | None:
    values = [rss for t, rss in samples if quarter * duration / 4 <= t < (quarter + 1) * duration / 4]
    return statistics.median(values) if values else None


async def soak(url: str, server_pid: int, work: Path, tier_dir: Path, args: argparse.Namespace) -> dict:
    report = Report()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client, \
            httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as viewers_client:
        attacks = Attacks(url, client, viewers_client, work, tier_dir, load_config())
        attacks.prepare()
        core_pid = _core_pid(server_pid)
        pids = {"server": server_pid, "core": core_pid}
        start = time.monotonic()
        tasks = [asyncio.create_task(traffic_worker(client, report, stop, seed, start))
                 for seed in range(args.concurrency)]
        tasks += [asyncio.create_task(neighbour(client, report, stop, start)),
                  asyncio.create_task(health_probe(client, report, stop, start)),
                  asyncio.create_task(rss_sampler(pids, report, stop, start))]
        tasks += [asyncio.create_task(viewer(viewers_client, report, stop)) for _ in range(args.viewers)]
        queue = [a for a in attacks.all() if not args.attacks or a.__name__ in args.attacks]
        k = 0
        while time.monotonic() - start < args.duration:
            await asyncio.sleep(min(args.attack_every, max(0.0, args.duration - (time.monotonic() - start))))
            if time.monotonic() - start >= args.duration:
                break
            attack = queue[k % len(queue)]
            k += 1
            t = round(time.monotonic() - start, 1)
            try:
                got = await attack()
            except Exception as e:  # an attack that breaks is reported, the soak goes on
                got = [f"attack raised {e!r}"]
            report.attacks.append((t, attack.__name__, got))
            print(f"[{t:7.1f} s] {attack.__name__}: {got}", flush=True)
        stop.set()
        await asyncio.wait(tasks, timeout=180)
        for task in tasks:
            task.cancel()
        duration = time.monotonic() - start
        final_core_pid = _core_pid(server_pid)
    # Every request has ended: the pool must be all free (cached blocks count as free).
    deadline = time.monotonic() + 60
    metrics = _metrics(url)
    while (metrics.get("vllm:num_requests_running", 0) or metrics.get("vllm:num_requests_waiting", 0)) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = _metrics(url)
    return _summary(report, duration, metrics, server_pid, core_pid, final_core_pid, args)


def _summary(report: Report, duration: float, metrics: dict, server_pid: int, core_pid: int | None,
             final_core_pid: int | None, args: argparse.Namespace) -> dict:
    gaps = sorted(report.gaps)
    health_latencies = sorted(h[2] for h in report.health)
    rss = {}
    for role, samples in report.rss.items():
        early, late = _quarter_median(samples, duration, 1), _quarter_median(samples, duration, 3)
        rss[role] = {"second_quarter_mb": round(early / 2**20, 1) if early else None,
                     "last_quarter_mb": round(late / 2**20, 1) if late else None,
                     "growth": round(late / early - 1, 4) if early and late else None}
    attack_5xx = [a for a in report.attacks if any(_status(s) >= 500 for s in a[2])]
    checks = {
        "no 5xx outside the attacks": not report.traffic_5xx,
        "no transport errors": not report.traffic_errors,
        "server still running": _rss(server_pid) is not None,
        "core never replaced": core_pid is not None and core_pid == final_core_pid,
        f"neighbour's longest gap <= {args.max_gap} s": bool(gaps) and gaps[-1] <= args.max_gap,
        "every KV block free at the end": metrics.get("vllm:kv_cache_usage_perc", 1.0) == 0.0,
        f"RSS flat within {args.rss_tolerance:.0%}": all(
            r["growth"] is not None and abs(r["growth"]) <= args.rss_tolerance for r in rss.values()),
        "/health always 200": all(h[1] == 200 for h in report.health),
    }
    return {
        "duration_s": round(duration, 1),
        "checks": checks,
        "passed": all(checks.values()),
        "traffic": {f"{kind} {status}": n for (kind, status), n in sorted(report.statuses.items())},
        "traffic_5xx": report.traffic_5xx[:20],
        "traffic_errors": report.traffic_errors[:20],
        "attacks": report.attacks,
        "attacks_with_5xx": attack_5xx,
        "neighbour_gaps_ms": {
            "count": len(gaps),
            "median": round(statistics.median(gaps) * 1e3, 1) if gaps else None,
            "p99": round(gaps[int(0.99 * (len(gaps) - 1))] * 1e3, 1) if gaps else None,
            "max": round(gaps[-1] * 1e3, 1) if gaps else None,
            "worst_at_s": [(round(g * 1e3, 1), t) for g, t in report.worst_gaps],
        },
        "health": {"probes": len(report.health),
                   "non_200": [h for h in report.health if h[1] != 200][:20],
                   "max_latency_ms": round(health_latencies[-1] * 1e3, 1) if health_latencies else None},
        "viewers": {"frames": report.viewer_frames, "errors": dict(report.viewer_errors)},
        "rss": rss,
        "kv_at_end": {k: metrics.get(k) for k in ("vllm:kv_cache_usage_perc", "pagedserve:kv_cache_free_blocks",
                                                  "pagedserve:kv_cache_total_blocks")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default: 600)")
    parser.add_argument("--attack-every", type=float, default=30.0, help="seconds between attacks (default: 30)")
    parser.add_argument("--viewers", type=int, default=50, help="dashboard readers (default: 50)")
    parser.add_argument("--concurrency", type=int, default=6, help="traffic clients (default: 6)")
    parser.add_argument("--max-gap", type=float, default=1.0, help="the neighbour's longest gap allowed, s")
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--attacks", nargs="+", default=None, metavar="NAME",
                        help="fire only these attacks (default: all, in turn)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra flag for the server")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pagedserve-soak-"))
    tier_dir = work / "tier"
    model_config = load_config()
    adapters = [write_random_adapter(str(work / name), model_config, rank=8, seed=i) for i, name in enumerate(ADAPTERS)]
    server_args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                   "--lora-modules", *(f"{n}={p}" for n, p in zip(ADAPTERS, adapters)),
                   "--kv-offload-dir", str(tier_dir), "--kv-offload-policy", "write_through",
                   "--max-num-seqs", "16", "--num-kv-blocks", "512", *args.server_arg]
    with launch("pagedserve", MODEL, api_key=API_KEY, extra_args=server_args) as server:
        print(f"server {server.url} (pid {server.pid}, log {server.log_path}); soaking for {args.duration:g} s",
              flush=True)
        report = asyncio.run(soak(server.url, server.pid, work, tier_dir, args))
        report["server_log"] = server.log_path
    print(json.dumps(report, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
