"""Faults injected into a real model, for the tests that check a fault stays with its request."""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Injected:
    raised: int = 0  # how many forward passes the fault has failed


@contextmanager
def forward_fails_for(model, token: int, layer: int = 10,
                      error: Callable[[], BaseException] = lambda: RuntimeError("injected fault in the forward pass")):
    """The model raises `error()` at `layer` (after the layers below it wrote their K/V) in every
    forward pass whose input holds `token`. Yields the count of faults raised."""
    armed = {"now": False}
    injected = Injected()
    real_forward = model.forward

    def forward(input_ids, *args, **kwargs):
        armed["now"] = bool((input_ids == token).any())
        return real_forward(input_ids, *args, **kwargs)

    def hook(module, args):
        if armed["now"]:
            injected.raised += 1
            raise error()

    model.forward = forward
    handle = model.model.layers[layer].register_forward_pre_hook(hook)
    try:
        yield injected
    finally:
        handle.remove()
        del model.forward
