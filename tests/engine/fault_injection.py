"""Faults injected into a real model, for the tests that check a fault stays with its request."""

from contextlib import contextmanager


@contextmanager
def forward_fails_for(model, token: int, layer: int = 10):
    """The model raises at `layer` (after the layers below it wrote their K/V) in every forward
    pass whose input holds `token`."""
    armed = {"now": False}
    real_forward = model.forward

    def forward(input_ids, *args, **kwargs):
        armed["now"] = bool((input_ids == token).any())
        return real_forward(input_ids, *args, **kwargs)

    def hook(module, args):
        if armed["now"]:
            raise RuntimeError("injected fault in the forward pass")

    model.forward = forward
    handle = model.model.layers[layer].register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        del model.forward
