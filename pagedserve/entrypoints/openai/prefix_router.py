"""A prefix-cache-aware Ray Serve request router for engine replicas.

A replica's prefix cache is keyed by chained block hashes (`kv.hash_block`), so the router can
hash a request's first blocks the same way and remember which replica it sent each hash to: the
replica that got a prefix before most likely still holds its blocks. A request goes to the
candidate that was sent its longest prefix, unless that replica's queue is longer than the
shortest by more than `imbalance_threshold` requests: then to the least loaded. A prefix no
replica was sent goes to the replica that holds the fewest remembered blocks (then the least
loaded), so that distinct prefixes spread over the caches rather than pile onto one.

The router lives in the process that holds the deployment handle (the OpenAI ingress); its
decisions, and each replica's figures it is sent, are recorded in `router_stats`, which the
ingress's /metrics reports. `ObservedPowerOfTwoChoices` (Ray Serve's default router) and
`ObservedPrefixCacheAffinity` (Ray Serve LLM's) record the same but the decisions, for comparison:
`serve --ray --router default|prefix-cache-affinity`.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from typing import Any

# Ray's own routers, from where the pinned Ray keeps them (Ray Serve LLM's public module for the
# second imports the rest of ray[llm], which needs pyarrow; this one needs only Ray).
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from pagedserve.kv import hash_block


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, max_blocks: int = 64, imbalance_threshold: int = 8,
                         max_entries: int = 200_000, **kwargs: Any) -> None:
        """block_size: the replicas' KV block size; max_blocks: how many leading blocks are hashed;
        imbalance_threshold: how many more queued requests the preferred replica may have than the
        least loaded one; max_entries: hashes remembered (least recently routed forgotten first)."""
        self.block_size, self.max_blocks = block_size, max_blocks
        self.imbalance_threshold, self.max_entries = imbalance_threshold, max_entries
        self.owner: OrderedDict[bytes, ReplicaID] = OrderedDict()  # block hash -> replica last sent it
        self.owned: Counter[ReplicaID] = Counter()  # blocks of `owner` per replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        from pagedserve.entrypoints.openai import router_stats  # at call time: see router_stats

        observe(self, candidate_replicas)
        by_load = sorted(candidate_replicas, key=lambda r: (self._load(r), random.random()))
        if pending_request is None or not by_load:
            return [by_load]
        by_id = {r.replica_id: r for r in candidate_replicas}
        hashes = self._hashes(pending_request)
        preferred = None
        for h in hashes:  # chained: a deeper match is a longer shared prefix
            owner = self.owner.get(h)
            if owner is None:
                break
            if owner in by_id:
                preferred = by_id[owner]
        if preferred is None:  # a new prefix: to the replica whose cache holds the fewest prefix blocks
            router_stats.DECISIONS["no_match"] += 1
            ranked = sorted(by_load, key=lambda r: self.owned[r.replica_id])
            # Claim it now, not when routed: requests being routed at the same time then see it.
            self._remember(hashes, ranked[0].replica_id)
            return [ranked[:1], ranked[1:]]  # Ray picks freely within a rank: the choice ranks alone
        if self._load(preferred) - self._load(by_load[0]) > self.imbalance_threshold:
            router_stats.DECISIONS["fallback"] += 1
            return [by_load]
        router_stats.DECISIONS["affinity"] += 1
        return [[preferred], [r for r in by_load if r is not preferred]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        from pagedserve.entrypoints.openai import router_stats

        router_stats.ROUTED[replica_id.unique_id] += 1
        self._remember(self._hashes(pending_request), replica_id)

    def _remember(self, hashes: list[bytes], replica_id: ReplicaID) -> None:
        for h in hashes:
            previous = self.owner.get(h)
            if previous is not None:
                self.owned[previous] -= 1
            self.owner[h] = replica_id
            self.owner.move_to_end(h)
            self.owned[replica_id] += 1
        while len(self.owner) > self.max_entries:
            self.owned[self.owner.popitem(last=False)[1]] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        forget(replica_id.unique_id)
        for h in [h for h, owner in self.owner.items() if owner == replica_id]:
            del self.owner[h]  # its cache died with it
        self.owned.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        forget_all_but(replicas)

    def _load(self, replica: RunningReplica) -> int:
        return queue_length(self, replica)

    def _hashes(self, pending_request: PendingRequest) -> list[bytes]:
        """The chained hashes of the prompt's first full blocks, as the replicas' KV managers make them
        (a LoRA adapter's blocks keyed apart from the base model's and other adapters', as there)."""
        args = pending_request.args  # (ReplicaRequest,) for generate; () for the replicas' other methods
        tokens = args[0].prompt_token_ids if args else []
        adapter = args[0].lora_request if args else None
        extra = None if adapter is None else ("lora", adapter.lora_int_id)
        bs, hashes = self.block_size, []
        for i in range(min(len(tokens) // bs, self.max_blocks)):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], extra))
        return hashes


class Observed:
    """Mixed into one of Ray's routers: it chooses as it does, and what it sees is recorded for the
    ingress's /metrics as the prefix-aware router records it."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        observe(self, candidate_replicas)
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        from pagedserve.entrypoints.openai import router_stats

        super().on_request_routed(pending_request, replica_id, result)
        router_stats.ROUTED[replica_id.unique_id] += 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        forget_all_but(replicas)


class ObservedPowerOfTwoChoices(Observed, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router."""


class ObservedPrefixCacheAffinity(Observed, PrefixCacheAffinityRouter):
    """Ray Serve LLM's prefix-aware router: a character trie of the prompts it routed (here the
    prompt's token ids, one character each: `ReplicaRequest.prompt`), in an actor of its own."""


def queue_length(router: RequestRouter, replica: RunningReplica) -> int:
    return router.replica_queue_len_cache.get(replica.replica_id) or 0


def observe(router: RequestRouter, candidate_replicas: list[RunningReplica]) -> None:
    """Record each candidate's latest routing stats (its engine's figures) and queue length."""
    from pagedserve.entrypoints.openai import router_stats

    for r in candidate_replicas:
        if r.routing_stats:
            router_stats.REPLICA_STATS[r.replica_id.unique_id] = r.routing_stats
        router_stats.QUEUE_LENGTH[r.replica_id.unique_id] = queue_length(router, r)


def forget(unique_id: str) -> None:
    from pagedserve.entrypoints.openai import router_stats

    router_stats.REPLICA_STATS.pop(unique_id, None)
    router_stats.QUEUE_LENGTH.pop(unique_id, None)


def forget_all_but(replicas: list[RunningReplica]) -> None:
    """Drop the figures of replicas no longer in the deployment (scaled down, replaced)."""
    from pagedserve.entrypoints.openai import router_stats

    live = {r.replica_id.unique_id for r in replicas}
    for unique_id in (set(router_stats.REPLICA_STATS) | set(router_stats.QUEUE_LENGTH)) - live:
        forget(unique_id)
