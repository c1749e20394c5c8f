"""What the prefix-aware router saw, per process (the OpenAI ingress's): its decisions, requests
per replica, and each replica's latest figures. The router writes here, the ingress's /metrics
reads. (A module of its own: Ray Serve may rebuild the router's class from a pickle, whose
functions would then see copies of their module's globals; an import at call time finds these.)"""

from __future__ import annotations

from collections import Counter
from typing import Any

# "affinity": sent to the replica holding its prefix; "fallback": that replica was too loaded;
# "no_match": no replica was sent this prefix before.
DECISIONS: Counter[str] = Counter()
ROUTED: Counter[str] = Counter()  # requests routed to each replica, by its unique id
QUEUE_LENGTH: dict[str, int] = {}  # requests ongoing at each replica, as the router last saw them
REPLICA_STATS: dict[str, dict[str, Any]] = {}  # each replica's `record_routing_stats`, by unique id
