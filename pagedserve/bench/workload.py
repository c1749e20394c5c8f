"""Seeded synthetic workloads: length distributions and arrival times."""

from __future__ import annotations

import math
import random


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose logarithm is uniform: many short, a few long."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def poisson_arrival_steps(rng: random.Random, n: int, rate: float) -> list[int]:
    """Arrival step of each of `n` requests for a Poisson process of `rate` requests per step."""
    t, steps = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        steps.append(int(t))
    return steps
