"""The models a server answers to: the base model under its served name, and LoRA adapters by
name. A request's `model` picks one (GET /v1/models lists them all, vLLM's cards: an adapter's
`root` is its directory, its `parent` the base model).

Adapters named at start (`--lora-modules`) are checked then, so a bad one stops the server before
it serves. With runtime updating on, POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and
remove adapters while the server runs (vLLM's routes and answers). Each adapter gets the next
lora_int_id, counting from 1, never given out twice: an adapter unloaded while its requests still
run keeps its id in the engine until they finish, and one loaded later under the same name is
another adapter to the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.protocol import ModelCard
from pagedserve.entrypoints.openai.serving_engine import APIError, bad_request
from pagedserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter served from the start: one entry of `--lora-modules`."""

    name: str
    path: str
    base_model_name: str | None = None  # vLLM's: the model it adapts (here only the served one)


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form
    '{"name": ..., "path": ..., "base_model_name": ...}' (base_model_name optional)."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {e}") from None
        if not isinstance(fields, dict) or set(fields) - {"name", "path", "base_model_name"} \
                or not all(isinstance(fields.get(key), str) and fields[key] for key in ("name", "path")) \
                or not isinstance(fields.get("base_model_name", ""), str):
            raise ValueError(f"--lora-modules: {text!r} must be a JSON object with the strings name and path, and "
                             "optionally base_model_name")
        return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path or a JSON object "
                         f"'{{\"name\": ..., \"path\": ...}}', got {text!r}")
    return LoRAModulePath(name, path)


class OpenAIServingModels:
    """The served models by name (event loop only). `base_model_path` is the base card's root
    (default: its name)."""

    def __init__(self, engine: EngineClient, base_model_name: str, lora_modules: Sequence[LoRAModulePath] = (), *,
                 base_model_path: str | None = None) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.base_model_path = base_model_path or base_model_name
        self._adapters: dict[str, LoRARequest] = {}  # by name, in the order they were added
        self._last_id = 0
        self._loading = asyncio.Lock()  # one runtime load at a time: a name is checked and taken together
        for module in lora_modules:
            if module.base_model_name is not None and module.base_model_name != base_model_name:
                raise ValueError(f"--lora-modules {module.name}: its base_model_name {module.base_model_name!r} is "
                                 f"not the served model {base_model_name!r}")
            problem = self._name_problem(module.name)
            if problem is not None:
                raise ValueError(f"--lora-modules {module.name}: {problem}")
            adapter = self._next(module.name, module.path)
            try:
                engine.check_lora(adapter)
            except ValueError as e:
                raise ValueError(f"--lora-modules {module.name}: {e}") from None
            self._adapters[module.name] = adapter

    @property
    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model, also when it names none);
        a 404 with OpenAI's model_not_found for a name the server does not serve."""
        if model is None or model == self.base_model_name:
            return None
        adapter = self._adapters.get(model)
        if adapter is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return adapter

    def cards(self) -> list[ModelCard]:
        base = ModelCard(id=self.base_model_name, root=self.base_model_path, max_model_len=self.engine.max_model_len)
        return [base, *(self._card(adapter) for adapter in self._adapters.values())]

    def card(self, model: str) -> ModelCard:
        adapter = self.resolve(model)
        return self.cards()[0] if adapter is None else self._card(adapter)

    def _card(self, adapter: LoRARequest) -> ModelCard:
        return ModelCard(id=adapter.lora_name, root=adapter.lora_path, parent=self.base_model_name,
                         max_model_len=self.engine.max_model_len)

    async def load(self, name: str, path: str, run_blocking: Callable[..., Awaitable], *,
                   replace: bool = False) -> str:
        """Add an adapter while serving: a 400 saying why when the name is taken (unless `replace`:
        vLLM's load_inplace, the name then stands for the new adapter and the old one's running
        requests finish with it) or the engine cannot serve it. `run_blocking` runs the check (file
        reads) off the event loop. Returns vLLM's answer, a line of text."""
        async with self._loading:
            problem = self._name_problem(name, replace)
            if problem is not None:
                raise bad_request(problem, "lora_name")
            adapter = self._next(name, path)
            try:
                await run_blocking(self.engine.check_lora, adapter)
            except ValueError as e:
                raise bad_request(str(e), "lora_path") from None
            old = self._adapters.get(name)
            self._adapters[name] = adapter
        if old is not None:
            self.engine.remove_lora(old.lora_int_id)
        logger.info("loaded LoRA adapter %r from %s (lora_int_id %d)", name, path, adapter.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Remove an adapter while serving: new requests for it get a 404, the ones running finish
        with it. A 404 for a name that is not loaded."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_adapter_not_found")
        self.engine.remove_lora(adapter.lora_int_id)
        logger.info("unloaded LoRA adapter %r (lora_int_id %d)", name, adapter.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _name_problem(self, name: str, replace: bool = False) -> str | None:
        if not name:
            return "an adapter needs a name"
        if name == self.base_model_name:
            return f"{name!r} is the base model's name"
        if name in self._adapters and not replace:
            return f"The lora adapter '{name}' has already been loaded."
        return None

    def _next(self, name: str, path: str) -> LoRARequest:
        """The adapter under the next id (spent even if the adapter is then refused: ids are never reused)."""
        self._last_id += 1
        return LoRARequest(name, self._last_id, path)
