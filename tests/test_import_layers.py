"""Imports run one way: each module imports only from its own layer or the layers below it.

Every import counts, at module level or inside a function (a lazy import still ties the two modules
together), including those under TYPE_CHECKING. A module that no layer names fails the test, so a new
module takes its place in this list on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedserve"

# Lowest first. An entry names a module or a package (then every module under it).
LAYERS: list[tuple[str, ...]] = [
    ("pagedserve.cache", "pagedserve.heap", "pagedserve.hugepages", "pagedserve.text", "pagedserve.outputs",
     "pagedserve.errors", "pagedserve.lifetime", "pagedserve.config", "pagedserve.kv.sizes", "pagedserve.kv.groups"),
    ("pagedserve.ops",),  # C-backed ops: what they compute, not who calls them
    ("pagedserve.structured_output",),
    ("pagedserve.sampling_params",),
    ("pagedserve.lora.request", "pagedserve.lora.slots"),  # which adapter a request names; the model's slots
    ("pagedserve.kv",),  # the block pool and its manager
    ("pagedserve.spec_decode",),  # speculative decoding: draft proposers, the rejection sampler
    ("pagedserve.attention",),
    ("pagedserve.offload",),  # the KV tier behind the pool: block files, and transfers in its layout
    ("pagedserve.distributed",),  # the tensor-parallel process group
    ("pagedserve.models",),
    ("pagedserve.lora",),  # LoRA adapters: their weights, the slots' stacks on the model, a runner's adapters
    # What the core plans and samples, which the worker side reads.
    ("pagedserve.core.request", "pagedserve.core.messages", "pagedserve.core.scheduler", "pagedserve.core.sampler",
     "pagedserve.core.kv_view"),
    ("pagedserve.worker",),
    ("pagedserve.executor",),
    ("pagedserve.core",),  # the engine core and its process
    ("pagedserve.dashboard",),  # the live KV view: the front's copy of the pool, its frames and page
    ("pagedserve.engine",),  # the front: requests in, outputs out, over any core client
    ("pagedserve.entrypoints",),
    ("pagedserve.bench",),
    ("pagedserve", "pagedserve.entrypoints.cli"),  # the package's lazy exports; the command line runs the benches
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    """The layer of the longest entry naming `module` or a package above it."""
    best, best_len = None, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            exact = entry == "pagedserve"
            if (module == entry or (not exact and module.startswith(entry + "."))) and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def imported_modules(module: str, path: Path) -> set[str]:
    """Every pagedserve module `module` imports, resolved to a module that exists."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # The root's dunders (__version__) are constants: importing them runs none of its lazy exports.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
                     if not (base == "pagedserve" and alias.name.startswith("__"))]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("pagedserve"):
                found.add(name)
    return found


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = layer_of(module)
    upward = [f"{dep} (layer {layer_of(dep)})" for dep in sorted(imported_modules(module, MODULES[module]))
              if layer_of(dep) is not None and mine is not None and layer_of(dep) > mine]
    assert upward == [], f"{module} (layer {mine}) imports from a layer above it"


def test_the_check_sees_a_function_level_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from pagedserve.engine.llm_engine import LLMEngine\n")
    assert imported_modules("pagedserve.kv.block_pool", source) == {"pagedserve.engine.llm_engine"}
    assert layer_of("pagedserve.engine.llm_engine") > layer_of("pagedserve.kv.block_pool")
