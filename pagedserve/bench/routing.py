"""`pagedserve bench routing`: prefix-cache hit rates of engine replicas on Ray Serve under each
request router, on one shared-system-prompt workload.

The workload: `num_prompts` distinct system prompts of `prompt_len` tokens, each
followed by a distinct `suffix_len`-token user part in `requests_per_prompt` requests, in random
order, `concurrency` at a time, over `replicas` replicas. Each replica's KV pool holds about
num_prompts / replicas of the prompts: a router that keeps each prompt on one replica finds it
cached; one that spreads every prompt over every replica makes the pools evict each other's
prompts. The hit rate is OpenAI's usage.prompt_tokens_details.cached_tokens over all prompt
tokens. Random routers (Ray Serve's default) differ from run to run: --repeats gives the spread.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench.servers import free_port
from pagedserve.bench.workload import system_prompts

ROUTER_NAMES = ("default", "prefix-cache-affinity", "prefix-aware")


def run_routing_bench(model: str | None = None, routers: tuple[str, ...] = ROUTER_NAMES, replicas: int = 2,
                      num_prompts: int = 4, prompt_len: int = 512, requests_per_prompt: int = 16,
                      suffix_len: int = 16, concurrency: int = 4, repeats: int = 1, seed: int = 0) -> list[dict]:
    """One row per router and repeat (`workload.system_prompts`, seed + repeat): hit rate, requests
    per replica, seconds. Starts a local Ray instance of its own and takes it down."""
    import openai
    import ray
    from ray import serve

    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.openai.ray_app import APP_NAME, build_ray_app

    block_size = EngineConfig().block_size
    prompt_blocks = prompt_len // block_size  # the full blocks of a system prompt: what can be cached
    own_blocks = math.ceil((prompt_len + suffix_len + 1) / block_size) - prompt_blocks  # a request's own tail
    # A pool that holds the replica's share of the prompts and one request's tail (and a little
    # room), not all the prompts.
    kv_blocks = math.ceil(num_prompts / replicas) * prompt_blocks + own_blocks + 4
    config = EngineConfig(model=model, num_kv_blocks=kv_blocks, max_model_len=prompt_len + suffix_len + 16)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging setup would print every request
    port = free_port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        for repeat in range(repeats):
            for router in routers:
                serve.run(build_ray_app(config, "bench", num_replicas=replicas, router=router), name=APP_NAME,
                          route_prefix="/")
                _wait_until_routable(url, client, replicas)
                workload = system_prompts(num_prompts, requests_per_prompt, seed + repeat, prompt_len, suffix_len)

                def send(prompt: list[int]):
                    return client.completions.create(model="bench", prompt=prompt, max_tokens=1).usage

                start = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    usages = list(pool.map(send, [r.prompt_token_ids for r in workload.requests]))
                seconds = time.perf_counter() - start
                per_replica = [v for k, v in _metrics(url).items() if k[0] == "pagedserve:router_requests_total"]
                rows.append({"router": router, "repeat": repeat, "seconds": seconds,
                             "hit_rate": sum(u.prompt_tokens_details.cached_tokens for u in usages)
                             / sum(u.prompt_tokens for u in usages),
                             "requests_per_replica": sorted(per_replica), "kv_blocks_per_replica": kv_blocks,
                             "workload": f"{num_prompts} system prompts of {prompt_len} tokens x {requests_per_prompt} "
                                         f"requests (+{suffix_len} tokens each), random order, {concurrency} at a "
                                         f"time, {replicas} replicas of {kv_blocks} KV blocks"})
                serve.delete(APP_NAME)  # fresh replicas, empty caches, for the next router
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def _metrics(url: str) -> dict[tuple[str, str], float]:
    """(sample name, replica label) -> value, from the ingress's /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, s.labels.get("replica", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def _wait_until_routable(url: str, client, replicas: int, timeout: float = 120.0) -> None:
    """Until the ingress's router has been offered every replica (the app is up before its handle
    has heard of them all, and a router offered one replica sends it everything)."""
    deadline = time.monotonic() + timeout
    while sum(name == "vllm:num_requests_running" for name, _ in _metrics(url)) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router was not offered {replicas} replicas within {timeout:.0f} s")
        client.completions.create(model="bench", prompt=[5, 6, 7], max_tokens=1)  # no full block: no prefix
        time.sleep(0.5)


def format_table(rows: list[dict]) -> str:
    routers = list(dict.fromkeys(r["router"] for r in rows))
    rates = {router: [r["hit_rate"] for r in rows if r["router"] == router] for router in routers}
    baseline = statistics.mean(rates["default"]) if "default" in rates else None
    lines = [rows[0]["workload"], "",
             "| router | prefix-cache hit rate (mean) | min / max | x default | requests per replica (each run) |",
             "|---|---:|---:|---:|---|"]
    for router in routers:
        mean = statistics.mean(rates[router])
        ratio = f"{mean / baseline:.2f}x" if baseline else "-"
        balance = "; ".join(":".join(f"{n:.0f}" for n in r["requests_per_replica"]) for r in rows
                            if r["router"] == router)
        lines.append(f"| {router} | {mean:.1%} | {min(rates[router]):.1%} / {max(rates[router]):.1%} | {ratio} | "
                     f"{balance} |")
    lines.append(f"\n{len(rates[routers[0]])} run(s) per router. default: Ray Serve's power of two choices; "
                 "prefix-cache-affinity: Ray Serve LLM's PrefixCacheAffinityRouter; prefix-aware: pagedserve's.")
    return "\n".join(lines)
