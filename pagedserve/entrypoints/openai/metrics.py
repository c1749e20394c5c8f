"""Prometheus metrics for /metrics, named as vLLM names them where vLLM has the figure.

Each app gets its own CollectorRegistry, so two servers can live in one process. Gauges and
counters are read at scrape time from the engine thread's latest stats snapshot; the latency
histograms are fed by a hook as each request finishes.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.engine.protocol import EngineClient, EngineStatsSnapshot
from pagedserve.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineCollector(Collector):
    """The engine's figures under vLLM's names. An engine whose figures come from several replicas
    (the Ray ingress's `ReplicaPool`) reports each replica's under a
    `replica` label."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        per_replica = self.engine.stats_by_replica()
        if per_replica is None:
            label_names, series = ["model_name"], [([self.model_name], self.engine.stats)]
        else:
            label_names = ["model_name", "replica"]
            series = [([self.model_name, replica], s) for replica, s in sorted(per_replica.items())]

        def family(kind, name: str, doc: str, value: Callable[[EngineStatsSnapshot], float]):
            metric = kind(name, doc, labels=label_names)
            for labels, s in series:
                metric.add_metric(labels, value(s))
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Sequences running (in the batch).",
                     lambda s: s.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Sequences waiting to be scheduled.",
                     lambda s: s.num_waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                     lambda s: s.kv.usage)
        yield family(GaugeMetricFamily, "pagedserve:kv_cache_total_blocks", "KV blocks in the pool.",
                     lambda s: s.kv.total_blocks)
        yield family(GaugeMetricFamily, "pagedserve:kv_cache_free_blocks",
                     "KV blocks free (cached prefixes included).", lambda s: s.kv.free_blocks)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda s: s.kv.prefix_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda s: s.kv.prefix_hits)
        yield family(CounterMetricFamily, "pagedserve:kv_offload_hits",
                     "Prompt tokens read from the KV tier (counted in vllm:prefix_cache_hits too).",
                     lambda s: s.kv.offload_hits)
        yield family(CounterMetricFamily, "pagedserve:kv_offload_stored_blocks", "KV blocks sent to the KV tier.",
                     lambda s: s.kv.offload_stored_blocks)
        yield family(CounterMetricFamily, "pagedserve:kv_offload_loaded_blocks", "KV blocks read back from the KV tier.",
                     lambda s: s.kv.offload_loaded_blocks)
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted (recomputed or swapped).",
                     lambda s: s.num_preemptions)
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens computed.",
                     lambda s: s.num_prompt_tokens)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Tokens generated.",
                     lambda s: s.num_generation_tokens)
        finished = CounterMetricFamily("vllm:request_success", "Sequences that ended, by reason.",
                                       labels=[*label_names, "finished_reason"])
        for labels, s in series:
            for reason in FINISH_REASONS:
                finished.add_metric([*labels, reason], s.finished.get(reason, 0))
        yield finished
        groups = GaugeMetricFamily("pagedserve:kv_cache_group_used_blocks",
                                   "KV blocks in use per KV cache group (window 0: full attention).",
                                   labels=[*label_names, "group", "window"])
        for labels, s in series:
            for g, (window, used) in enumerate(s.kv_groups):
                groups.add_metric([*labels, str(g), str(window)], used)
        yield groups
        spec_series = [(labels, s.spec) for labels, s in series if s.spec is not None]
        if not spec_series:
            return
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Request-steps that verified drafts.", lambda c: c.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                 lambda c: c.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda c: c.num_accepted_tokens)):
            metric = CounterMetricFamily(name, doc, labels=label_names)
            for labels, spec in spec_series:
                metric.add_metric(labels, value(spec))
            yield metric
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by their position among the drafts.",
                                           labels=[*label_names, "position"])
        for labels, spec in spec_series:
            for position, count in enumerate(spec.accepted_per_position):
                per_position.add_metric([*labels, str(position)], count)
        yield per_position


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: EngineClient, model_name: str, extra_collectors: tuple = ()) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        for collector in extra_collectors:  # e.g. the Ray ingress's router and per-replica figures
            self.registry.register(collector)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "From arrival to the first generated token.")
        self.time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                               "Per request: mean time between its generated tokens.")
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds", "From arrival to the last token.")
        # TTFT = queue + prefill and E2E = queue + inference: whether a slow first token waited
        # for a turn (load) or for its own prompt to compute. Arrival is when the server took the
        # request, so the queue includes the rest of the step running then.
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "From arrival to the scheduler's first admission of the request.")
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "From the first admission to the first generated token.")
        self.decode_time = histogram("vllm:request_decode_time_seconds", "From the first generated token to the last.")
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "From the first admission to the last token.")
        engine.add_finish_hook(self.observe_finished)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        arrival, first, finish = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        if None in (arrival, first, finish):
            return
        self.time_to_first_token.observe(first - arrival)
        self.e2e_latency.observe(finish - arrival)
        self.decode_time.observe(finish - first)
        scheduled = m.get("first_scheduled_time")
        if scheduled is not None:
            self.queue_time.observe(scheduled - arrival)
            self.prefill_time.observe(first - scheduled)
            self.inference_time.observe(finish - scheduled)
        num_tokens = max(len(o.token_ids) for o in output.outputs)
        if num_tokens > 1:
            self.time_per_output_token.observe((finish - first) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
