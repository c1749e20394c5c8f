"""Faults injected into a real model or engine core: for the tests that check a fault stays with its
request, and that a stuck core is found and replaced."""

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


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


def block_steps_on(token: int) -> None:
    """From now on, in this process, an engine core's step blocks for good once a request whose
    prompt holds `token` has been added, and SIGTERM no longer ends the process (as for a core stuck
    where a gentle signal does not reach it): only SIGKILL does."""
    from pagedserve.core.engine_core import EngineCore

    real_add, real_step = EngineCore.add_request, EngineCore.step

    def add_request(self, request):
        if token in request.prompt_token_ids:
            self.blocked_by_fault = True
        real_add(self, request)

    def step(self):
        if getattr(self, "blocked_by_fault", False):
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            threading.Event().wait()  # forever
        return real_step(self)

    EngineCore.add_request, EngineCore.step = add_request, step


def run_faulty_core(block_on: int, hold_while: str | None, *args) -> None:
    """`run_engine_core` (the core process's main: `ProcessCoreClient(core_main=partial(run_faulty_core,
    block_on, hold_while))`) with two faults: a step blocks for good on a request holding token
    `block_on` (block_steps_on); and a core whose step loop is about to start (after it reported
    ready) while the file `hold_while` exists holds it until the file is removed, having created
    `hold_while + ".held"` to say so."""
    from pagedserve.core import core_process

    block_steps_on(block_on)
    real_loop = core_process._busy_loop

    def busy_loop(*loop_args):
        if hold_while is not None and os.path.exists(hold_while):
            Path(hold_while + ".held").touch()
            while os.path.exists(hold_while):
                time.sleep(0.02)
        return real_loop(*loop_args)

    core_process._busy_loop = busy_loop
    core_process.run_engine_core(*args)
