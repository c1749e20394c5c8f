"""`pagedserve serve --ray`: engine replicas on Ray Serve behind one OpenAI ingress.

Each `EngineReplica` is a Ray Serve replica (an actor) holding a whole engine with its own KV pool
(an `AsyncLLM` whose core runs in a process of its own, as `pagedserve serve` runs it). The ingress
is the same FastAPI app as `pagedserve serve` (`build_app`), run by Ray Serve's HTTP proxy, over a
`ReplicaPool`: an `EngineClient` whose `generate` streams from a replica through a
DeploymentHandle. Which replica takes a request is the handle's request router's choice: Ray
Serve's default (power of two choices), or pagedserve's prefix-cache-aware one
(`prefix_router.PrefixAwareRouter`). Ray does placement, health checks, restarts and autoscaling.

The ingress tokenizes (as the single-process server does), so a replica receives token ids and
the router can hash the prompt's first blocks. LoRA adapters are the ingress's to name and check
(`OpenAIServingModels`, against the model's config, before any replica starts for --lora-modules);
a request carries its adapter to whichever replica takes it, which reads it on first use. Unloading
reaches no replica (a handle cannot address them all): the registry forgets the name, and replicas
drop the adapter from host memory as others push it out (least recently used); ids are never
reused, so a stale copy is never mistaken for a new adapter.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve

from pagedserve.config import EngineConfig
from pagedserve.engine.input_processor import check_adapter
from pagedserve.engine.protocol import EngineError, EngineStatsSnapshot
from pagedserve.entrypoints.openai.router_stats import DECISIONS, QUEUE_LENGTH, REPLICA_STATS, ROUTED
from pagedserve.entrypoints.openai.serving_models import LoRAModulePath
from pagedserve.kv import KVCacheStats
from pagedserve.lora.request import LoRARequest
from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import load_config
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

APP_NAME = "pagedserve"
ROUTERS = {  # --router: the request router class of the replicas' handle
    "prefix-aware": "pagedserve.entrypoints.openai.prefix_router:PrefixAwareRouter",
    "default": "pagedserve.entrypoints.openai.prefix_router:ObservedPowerOfTwoChoices",  # Ray Serve's
    "prefix-cache-affinity": "pagedserve.entrypoints.openai.prefix_router:ObservedPrefixCacheAffinity",  # Ray LLM's
}
INGRESS_MAX_ONGOING_REQUESTS = 100_000
MAX_ATTEMPTS = 3  # replicas a request that has streamed nothing yet may be sent to


@dataclasses.dataclass
class ReplicaRequest:
    """A request as the ingress sends it to a replica: the argument the routers read."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt_text: str | None = None
    lora_request: LoRARequest | None = None

    @property
    def prompt(self) -> str:
        """One character per token id: Ray Serve LLM's router matches character prefixes of
        `prompt`, which then are token prefixes, what the replicas' caches hold."""
        return "".join(map(chr, self.prompt_token_ids))


@serve.deployment
class EngineReplica:
    """One engine, serving token-id requests streamed back as RequestOutputs. Its actor reserves
    the CPUs the engine computes on, and Ray sets OMP_NUM_THREADS to their number, which the core
    process inherits: replicas on one machine then share its cores instead of oversubscribing them."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.entrypoints.openai.api_server import make_async_engine

        # The core in a process of its own, as `pagedserve serve` runs it: the actor's thread, which
        # streams every token through Ray, then does not compete with the engine for the GIL.
        self.engine = make_async_engine(config, "process")
        self.engine.start()

    def info(self) -> dict[str, int]:
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "max_num_seqs": self.engine.max_num_seqs}

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestOutput]:
        async for output in self.engine.generate(request.prompt_token_ids, request.params, request.request_id,
                                                 prompt_text=request.prompt_text, lora_request=request.lora_request):
            yield output

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's figures (its EngineStatsSnapshot), which Ray Serve polls each second for
        the router; the ingress's /metrics reports them under a replica label."""
        return dataclasses.asdict(self.engine.stats)

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine is not running")

    def __del__(self) -> None:
        self.engine.shutdown()


class ReplicaPool:
    """The engine the OpenAI app serves (`engine.protocol.EngineClient`), over the replicas' handle."""

    stats = None  # the figures come per replica
    kv_watch = None  # no one pool to show: each replica has its own

    def __init__(self, handle: Any, tokenizer: Any, info: dict[str, int], config: EngineConfig | None = None) -> None:
        self.handle, self.tokenizer, self.config = handle.options(stream=True), tokenizer, config
        self.max_model_len, self.vocab_size, self.max_num_seqs = (
            info["max_model_len"], info["vocab_size"], info["max_num_seqs"])
        self._hooks: tuple[Callable[[RequestOutput], None], ...] = ()

    def health_problem(self) -> str | None:
        return None  # Ray Serve restarts a replica that fails its health check

    def check_lora(self, adapter: LoRARequest) -> None:
        check_lora(self.config, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        """Nothing to tell the replicas: see the module's docstring."""

    def watch_kv(self, seconds: float) -> None:
        """No live KV view across replicas (`kv_watch` is None)."""

    def stats_by_replica(self) -> dict[str, EngineStatsSnapshot]:
        """Each live replica's latest figures, by its unique id (refreshed each second)."""
        return {replica: EngineStatsSnapshot(**{**stats, "kv": KVCacheStats(**stats["kv"])})
                for replica, stats in list(REPLICA_STATS.items())}

    def add_finish_hook(self, hook: Callable[[RequestOutput], None]) -> None:
        self._hooks = (*self._hooks, hook)

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request from the replica the router picks. A refused request raises
        ValueError, a replica's fault EngineError, as the in-process engine does. When the replica
        dies before the request streamed anything, the request goes to another replica (the router
        has been told it died): the client sees nothing of it."""
        from ray.exceptions import RayActorError

        output = None
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                stream = self.handle.generate.remote(ReplicaRequest(list(prompt), params, request_id, prompt_text,
                                                                    lora_request))
                try:
                    async for output in stream:
                        yield output
                    break
                except (ValueError, EngineError):  # Ray re-raises the replica's error as a subclass of its type
                    raise
                except RayActorError as e:  # the replica's actor died, or Ray cannot reach it
                    if output is not None or attempt == MAX_ATTEMPTS:
                        raise EngineError(f"the replica serving this request failed: {e}") from e
                    logger.warning("request %s: its replica failed before it streamed anything; sending it to "
                                   "another (attempt %d of %d)", request_id, attempt + 1, MAX_ATTEMPTS)
                except Exception as e:  # anything else Ray could not deliver
                    raise EngineError(f"the replica serving this request failed: {e}") from e
        finally:
            if output is not None and output.finished:
                for hook in self._hooks:
                    hook(output)


@functools.lru_cache(maxsize=4)
def _model_config(model: str | None) -> ModelConfig:
    return load_config(model)


def check_lora(config: EngineConfig, adapter: LoRARequest) -> None:
    """ValueError unless the replicas (all built from `config`) can serve `adapter`: checked where
    the registry lives, against the model's config (the adapter's directory must be readable there
    and on the replicas' machines alike)."""
    check_adapter(adapter, config, _model_config(config.model))


class RouterCollector:
    """/metrics of the ingress: the router's decisions, and per replica the requests routed to it
    and its queue as the router sees it. (Each replica's engine figures are the app's vllm:*
    metrics, under a replica label: `ReplicaPool.stats_by_replica`.)"""

    def collect(self):
        decisions = CounterMetricFamily("pagedserve:router_decisions", "Prefix-aware routing decisions: affinity "
                                        "(sent to the replica holding the prefix), fallback (it was too loaded), "
                                        "no_match.", labels=["decision"])
        for decision in ("affinity", "fallback", "no_match"):
            decisions.add_metric([decision], DECISIONS[decision])
        yield decisions
        routed = CounterMetricFamily("pagedserve:router_requests", "Requests routed to each replica.", labels=["replica"])
        for replica, n in ROUTED.items():
            routed.add_metric([replica], n)
        yield routed
        queue = GaugeMetricFamily("pagedserve:router_replica_queue_length", "Requests ongoing at each replica, as "
                                  "the router last saw them.", labels=["replica"])
        for replica, n in QUEUE_LENGTH.items():
            queue.add_metric([replica], n)
        yield queue


def build_ray_app(config: EngineConfig, served_model_name: str, api_key: str | None = None, *,
                  num_replicas: int = 1, autoscale: tuple[int, int] | None = None, replica_cpus: int | None = None,
                  router: str = "prefix-aware", router_kwargs: dict | None = None,
                  autoscaling_options: dict | None = None, lora_modules: Sequence[LoRAModulePath] = (),
                  **app_options) -> Any:
    """The Serve application: `num_replicas` engine replicas (or autoscaled between the bounds of
    `autoscale`) behind the OpenAI ingress. replica_cpus: the CPUs each replica reserves and
    computes on (default: this machine's cores shared among the most replicas there can be);
    router: a key of ROUTERS, router_kwargs its options; autoscaling_options: more fields of Ray
    Serve's AutoscalingConfig (upscale_delay_s, look_back_period_s, ...), over ours; lora_modules:
    LoRA adapters served by name, checked here (ValueError) before anything is deployed."""
    from ray.serve.config import RequestRouterConfig

    from pagedserve.entrypoints.openai.serving_models import OpenAIServingModels

    if lora_modules:
        OpenAIServingModels(_Checker(config), served_model_name, lora_modules)

    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
    if autoscaling_options and autoscale is None:
        raise ValueError("autoscaling_options apply only with autoscale=(min, max)")
    if replica_cpus is None:
        replica_cpus = max(1, len(os.sched_getaffinity(0)) // (autoscale[1] if autoscale else num_replicas))
    actor_options: dict[str, Any] = {"num_cpus": replica_cpus}
    if config.device.startswith("cuda"):  # one GPU per tensor-parallel rank, on one machine
        actor_options["num_gpus"] = config.tensor_parallel_size
    replica_options: dict[str, Any] = {"ray_actor_options": actor_options}
    if autoscale is not None:
        replica_options["autoscaling_config"] = {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                                 "target_ongoing_requests": config.max_num_seqs // 2 or 1,
                                                 **(autoscaling_options or {})}
    else:
        replica_options["num_replicas"] = num_replicas
    if router == "prefix-aware":
        router_kwargs = {"block_size": config.block_size, **(router_kwargs or {})}
    replica_options["request_router_config"] = RequestRouterConfig(
        request_router_class=ROUTERS[router], request_router_kwargs=router_kwargs or {},
        request_routing_stats_period_s=1.0)
    replicas = EngineReplica.options(max_ongoing_requests=config.max_num_seqs * 2, **replica_options).bind(config)

    def build_ingress_app():
        from pagedserve.entrypoints.openai.api_server import build_app
        from pagedserve.models.loader import load_tokenizer

        handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
        # The builder runs on the ingress's event loop, where a handle may not block: ask from a thread.
        with ThreadPoolExecutor(1) as pool:
            info = pool.submit(lambda: handle.info.remote().result()).result()
        pool = ReplicaPool(handle, load_tokenizer(config.model), info, config)
        models = OpenAIServingModels(pool, served_model_name, lora_modules, base_model_path=config.model)
        return build_app(pool, models, api_key, extra_collectors=(RouterCollector(),), **app_options)

    # The ingress only forwards: Serve's default cap of 5 ongoing requests would queue the rest at
    # the proxy while the replicas idle. The replicas' own caps bound the work in flight.
    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
    @serve.ingress(build_ingress_app)
    class OpenAIIngress:
        def __init__(self, replicas: Any) -> None:
            self.replicas = replicas  # bound so that Serve deploys them with the ingress

    return OpenAIIngress.bind(replicas)


@dataclasses.dataclass
class _Checker:
    """Checks adapters against the model as ReplicaPool does, before there are replicas."""

    config: EngineConfig

    def check_lora(self, adapter: LoRARequest) -> None:
        check_lora(self.config, adapter)


def run_ray_server(config: EngineConfig, served_model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                   ray_address: str | None = None, **options) -> None:
    """Start a local Ray instance (or join `ray_address`'s cluster), deploy the app, serve until
    interrupted; then take the app down, and with a local instance, all of Ray."""
    import ray

    ray.init(address=ray_address or "local", include_dashboard=False)  # "local": a new instance, never one found running
    # Ray's handler for SIGTERM aborts the driver and leaves a local instance's agents running:
    # take SIGTERM as Ctrl-C is taken, through the cleanup below.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_ray_app(config, served_model_name, **options), name=APP_NAME, route_prefix="/",
                  blocking=True)
    finally:
        if ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def parse_autoscale(text: str) -> tuple[int, int]:
    """"MIN..MAX" -> (MIN, MAX)."""
    low, sep, high = text.partition("..")
    if not sep or not low.isdigit() or not high.isdigit() or not 0 < int(low) <= int(high):
        raise ValueError(f"--autoscale takes MIN..MAX with 0 < MIN <= MAX, got {text!r}")
    return int(low), int(high)
