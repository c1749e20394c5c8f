"""LoRA adapters made with PEFT, and PEFT's own view of them: the references multi-LoRA serving
must match. Registered for every test directory by tests/conftest.py (pytest_plugins).

- `make_peft_adapter(hf_model, path, ...)`: a random adapter, saved by PEFT's save_pretrained.
- `merged_reference(hf_model, path)`: transformers + PEFT with the adapter merged into the weights.
- `peft_lora_modules(hf_model, path)`: each module's A, B and scaling as PEFT loads them.
- fixtures `embedded_adapter(name)` and `tiny_adapter(name, arch="llama")`: the adapters of
  EMBEDDED_ADAPTERS / TINY_ADAPTERS for the embedded SmolLM2 and the tiny checkpoints, made once per
  session.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from pagedserve.lora.weights import PROJECTIONS

# The ratio of each projection's delta (scaling * B @ A) to its base weight, root mean square. At
# 0.1 on every projection the embedded model's greedy reply to "Write a haiku about the sea."
# changes from its first token and stays fluent; at 0.15 replies repeat themselves, at 0.2 they are
# gibberish.
DEFAULT_SCALE = 0.1

# name -> make_peft_adapter's keywords, for the embedded model (30 layers).
EMBEDDED_ADAPTERS = {
    "r8": dict(rank=8, alpha=16, seed=1),
    "r16": dict(rank=16, alpha=32, seed=2),
    "r4-qv": dict(rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=3),
    "r8-mlp-rslora": dict(rank=8, alpha=4, targets=("gate_proj", "up_proj", "down_proj"), use_rslora=True, seed=4),
}
# name -> make_peft_adapter's keywords, for a tiny checkpoint (2 layers).
TINY_ADAPTERS = {
    "r4": dict(rank=4, alpha=8, seed=11),
    "r2-attn": dict(rank=2, alpha=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=12),
    "r8-rslora": dict(rank=8, alpha=4, use_rslora=True, seed=13),
    # per-module ranks and alphas; the regular expressions are matched as PEFT matches them
    "patterns": dict(rank=4, alpha=8, seed=14,
                     rank_pattern={"layers.1.self_attn.q_proj": 2, r"mlp\.(gate|up)_proj": 6},
                     alpha_pattern={"v_proj": 3, "down_proj": 12, r"model\.layers\.0\..*": 5}),
    "one-layer": dict(rank=4, alpha=8, targets=("k_proj", "down_proj"), seed=15, layers_to_transform=[1]),
}


def make_peft_adapter(hf_model: torch.nn.Module, path: str | Path, *, rank: int, alpha: float,
                      targets: Iterable[str] = PROJECTIONS, seed: int, use_rslora: bool = False,
                      scale: float = DEFAULT_SCALE, **lora_config) -> Path:
    """A random LoRA adapter for hf_model, made and saved by PEFT (safetensors) into `path`. Every
    module's delta is `scale` times its base weight in root mean square, whatever its rank and
    scaling. lora_config: more LoraConfig keywords (rank_pattern, alpha_pattern, ...). hf_model
    is left as it was: PEFT wraps a copy."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, **lora_config)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=gen))
                b.copy_(torch.randn(b.shape, generator=gen))
                base = module.get_base_layer().weight
                b.mul_(scale * _rms(base) / _rms(module.get_delta_weight("default")))
    model.save_pretrained(str(path))
    return Path(path)


def merged_reference(hf_model: torch.nn.Module, adapter_path: str | Path) -> torch.nn.Module:
    """transformers' model with the adapter merged into its weights by PEFT (merge_and_unload),
    float32, eval; hf_model is left as it was."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_path)).merge_and_unload()
    return torch.nn.Module.float(merged).eval()  # (transformers' own .float() refuses a model read from a GGUF)


def peft_lora_modules(hf_model: torch.nn.Module, adapter_path: str | Path
                      ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, projection) -> (A, B, scaling) as PEFT's PeftModel.from_pretrained loads the adapter."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_path))
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            layer = int(name.split(".layers.")[1].split(".")[0])
            found[layer, name.rpartition(".")[2]] = (module.lora_A["default"].weight.detach().clone(),
                                                     module.lora_B["default"].weight.detach().clone(),
                                                     float(module.scaling["default"]))
    return found


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.float().pow(2).mean().sqrt()


@pytest.fixture(scope="session")
def embedded_adapter(embedded_hf_model, tmp_path_factory) -> Callable[[str], Path]:
    """name (of EMBEDDED_ADAPTERS) -> the adapter's directory, for the embedded SmolLM2; each made
    on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_peft_adapter(embedded_hf_model, tmp_path_factory.mktemp(f"lora-embedded-{name}"),
                                           **EMBEDDED_ADAPTERS[name])
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_adapter(tiny_checkpoint, tmp_path_factory) -> Callable[..., Path]:
    """(name of TINY_ADAPTERS, arch="llama") -> the adapter's directory, for tiny_checkpoint(arch);
    each made on first use."""
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, arch: str = "llama") -> Path:
        if (name, arch) not in made:
            _, hf_model = tiny_checkpoint(arch)
            made[name, arch] = make_peft_adapter(hf_model, tmp_path_factory.mktemp(f"lora-{arch}-{name}"),
                                                 **TINY_ADAPTERS[name])
        return made[name, arch]

    return get
