"""PEFT adapters read and loaded: every adapter we cannot serve as PEFT would is refused with a
message that says why, and the A and B we load are PEFT's own times its scaling, merge into the
weights PEFT's merge_and_unload gives, and cut for tensor parallelism put back together into the
whole delta."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.lora.weights import (CONFIG_FILE, FUSED_PARTS, PROJECTIONS, WEIGHTS_FILE, AdapterInfo, LoRAWeights,
                                     adapter_identity, load_adapter, read_adapter)
from pagedserve.models.loader import load_config
from pagedserve.models.sharding import TPShard
from tests.lora.lora_fixtures import make_peft_adapter, merged_reference, peft_lora_modules

PREFIX = "base_model.model.model.layers"
Q_A, Q_B = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
MAX_RANK = 16


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    """(ModelConfig, transformers model) of the tiny Llama: 2 layers, 4 heads, 2 KV heads."""
    path, hf_model = tiny_checkpoint("llama")
    return load_config(str(path)), hf_model


def edited(adapter: Path, tmp_path: Path, config: dict | None = None,
           tensors: Callable[[dict], dict] | None = None) -> Path:
    """A copy of an adapter with its config updated by `config` and its tensors passed through
    `tensors`."""
    out = tmp_path / "edited"
    shutil.copytree(adapter, out)
    if config is not None:
        settings = json.loads((out / CONFIG_FILE).read_text())
        settings.update(config)
        (out / CONFIG_FILE).write_text(json.dumps(settings))
    if tensors is not None:
        save_file(tensors(load_file(out / WEIGHTS_FILE)), out / WEIGHTS_FILE, metadata={"format": "pt"})
    return out


def refused(path: Path, config, pattern: str, max_rank: int = MAX_RANK) -> None:
    """Both read_adapter and load_adapter raise ValueError matching `pattern`, naming the path."""
    with pytest.raises(ValueError, match=pattern) as e:
        read_adapter(path, config, max_rank)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError, match=pattern):
        load_adapter(path, config, max_rank, torch.float32, TPShard.of(config))


# -- the directory and its config ---------------------------------------------------------------------------------

def test_a_missing_directory_is_named(llama, tmp_path):
    refused(tmp_path / "nowhere", llama[0], r"does not exist; pass a directory as PEFT's save_pretrained writes")
    (tmp_path / "file").write_text("")
    refused(tmp_path / "file", llama[0], r"is a file, not a directory")


def test_a_directory_without_adapter_config_is_refused(llama, tiny_adapter, tmp_path):
    path = edited(tiny_adapter("r4"), tmp_path)
    (path / CONFIG_FILE).unlink()
    refused(path, llama[0], r"no adapter_config\.json")


@pytest.mark.parametrize("content, reason", [("{r: 4", "is not valid JSON"),
                                             ("[4]", "holds a JSON list, not the object expected")])
def test_a_damaged_adapter_config_is_named(llama, tiny_adapter, tmp_path, content, reason):
    path = edited(tiny_adapter("r4"), tmp_path)
    (path / CONFIG_FILE).write_text(content)
    refused(path, llama[0], rf"adapter_config\.json {reason}")


def test_an_adapter_of_another_peft_method_is_refused(llama, tiny_adapter, tmp_path):
    refused(edited(tiny_adapter("r4"), tmp_path, {"peft_type": "IA3"}), llama[0],
            r"peft_type is 'IA3'; only LoRA adapters \(peft_type 'LORA'\)")


def test_pickle_weights_are_not_loaded(llama, tiny_adapter, tmp_path):
    path = edited(tiny_adapter("r4"), tmp_path)
    (path / WEIGHTS_FILE).rename(path / "adapter_model.bin")
    refused(path, llama[0], r"has adapter_model\.bin but no adapter_model\.safetensors; .* does not load pickle")
    (path / "adapter_model.bin").unlink()
    refused(path, llama[0], r"no adapter_model\.safetensors")


def test_a_damaged_safetensors_file_is_named(llama, tiny_adapter, tmp_path):
    path = edited(tiny_adapter("r4"), tmp_path)
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[:100])
    refused(path, llama[0], r"adapter_model\.safetensors is not a valid safetensors file")


def test_a_rank_above_max_lora_rank_names_both_and_the_setting(llama, tiny_adapter):
    refused(tiny_adapter("r8-rslora"), llama[0], r"its rank 8 is above max_lora_rank=4; raise the max_lora_rank "
            r"setting to at least 8", max_rank=4)
    refused(tiny_adapter("patterns"), llama[0], r"its rank 6 is above max_lora_rank=5", max_rank=5)  # rank_pattern's
    assert read_adapter(tiny_adapter("r8-rslora"), llama[0], 8).rank == 8


ONLY_PROJECTIONS = r"only the attention and MLP projections \(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, " \
                   r"down_proj\) can carry LoRA here"


@pytest.mark.parametrize("config, pattern", [
    ({"target_modules": ["q_proj", "lm_head"]}, rf"target_modules names 'lm_head'; {ONLY_PROJECTIONS}"),
    ({"target_modules": ["embed_tokens", "v_proj"]}, rf"target_modules names 'embed_tokens'; {ONLY_PROJECTIONS}"),
    ({"target_modules": ".*(proj|head)"}, rf"target_modules '.\*\(proj\|head\)' matches lm_head; {ONLY_PROJECTIONS}"),
    ({"modules_to_save": ["lm_head"]},
     rf"modules_to_save \(lm_head\) carries fully trained copies .*; {ONLY_PROJECTIONS}"),
    ({"trainable_token_indices": [3, 5]}, rf"trainable_token_indices trains embeddings .*; {ONLY_PROJECTIONS}"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, rf"target_parameters adapts parameters .*; {ONLY_PROJECTIONS}"),
    ({"use_dora": True}, r"use_dora: DoRA adapters are not served .*merge_and_unload, or train a plain LoRA"),
    ({"bias": "lora_only"}, r"bias='lora_only': the adapter carries trained biases, which are not served; "
                            r"train with bias='none'"),
    ({"lora_bias": True}, r"lora_bias: LoRA B with a bias is not served"),
    ({"fan_in_fan_out": True},
     r"fan_in_fan_out is set: that layout is for GPT-2's Conv1D layers.*fan_in_fan_out=False"),
    ({"init_lora_weights": "pissa_niter_4"}, r"init_lora_weights='pissa_niter_4' trains against base weights PEFT "
                                             r"changed .*path_initial_model_for_weight_conversion"),
    ({"layer_replication": [[0, 2], [1, 2]]}, r"layer_replication stacks copies of layers"),
    ({"alora_invocation_tokens": [5, 6]}, r"alora_invocation_tokens is set: a LoRA variant that is not served"),
    ({"r": 0}, r"r must be a positive integer, got 0"),
    ({"alpha_pattern": {"q_proj": "big"}}, r"alpha_pattern must map module names to numbers"),
    ({"rank_pattern": {"q_proj(": 2}}, r"rank_pattern key 'q_proj\(' is not a valid regular expression"),
], ids=["lm_head", "embed_tokens", "regex-lm_head", "modules_to_save", "trainable_tokens", "target_parameters", "dora",
        "bias", "lora_bias", "fan_in_fan_out", "pissa", "layer_replication", "alora", "bad-r", "bad-alpha_pattern",
        "bad-rank_pattern"])
def test_settings_plain_lora_cannot_honour_are_refused(llama, tiny_adapter, tmp_path, config, pattern):
    refused(edited(tiny_adapter("r4"), tmp_path, config), llama[0], pattern)


def test_the_targets_peft_writes_for_all_linear_and_suffixes_are_accepted(llama, tiny_adapter, tmp_path):
    targets = ["all-linear", ["self_attn.q_proj", "model.layers.1.mlp.down_proj", "k_proj"], r".*\.(q|v)_proj"]
    for i, target in enumerate(targets):
        path = edited(tiny_adapter("r4"), tmp_path / str(i), {"target_modules": target})
        assert read_adapter(path, llama[0], MAX_RANK).rank == 4


def test_a_real_dora_adapter_is_refused(llama, tmp_path):
    path = make_peft_adapter(llama[1], tmp_path / "dora", rank=4, alpha=8, seed=0, use_dora=True)
    refused(path, llama[0], r"use_dora: DoRA adapters are not served")
    refused(edited(path, tmp_path, {"use_dora": False}), llama[0],
            r"lora_magnitude_vector.*it is DoRA's magnitude vector")


def test_a_real_adapter_on_the_lm_head_is_refused(llama, tmp_path):
    path = make_peft_adapter(llama[1], tmp_path / "head", rank=4, alpha=8, seed=0, targets=("q_proj", "lm_head"))
    refused(path, llama[0], rf"target_modules names 'lm_head'; {ONLY_PROJECTIONS}")
    # and with a config that does not say so, its tensors give it away
    refused(edited(path, tmp_path, {"target_modules": ["q_proj"]}), llama[0],
            rf"tensor 'base_model\.model\.lm_head\.[\w.]+' is not the lora_A or lora_B weight .*; "
            rf"{ONLY_PROJECTIONS}")


def rename(old: str, new: str) -> Callable[[dict], dict]:
    return lambda tensors: {new if name == old else name: t for name, t in tensors.items()}


def add(name: str, tensor: torch.Tensor) -> Callable[[dict], dict]:
    return lambda tensors: {**tensors, name: tensor}


NOT_LORA = r"is not the lora_A or lora_B weight of a decoder layer's projection \(q_proj, .*down_proj\)"


@pytest.mark.parametrize("tensors, pattern", [
    (rename(Q_A, Q_A.replace("lora_A", "lora_C")), rf"'{Q_A.replace('lora_A', 'lora_C')}' {NOT_LORA} as PEFT names"),
    (rename(Q_A, Q_A.replace("self_attn", "mlp")), rf"'{Q_A.replace('self_attn', 'mlp')}' {NOT_LORA}"),
    (rename(Q_A, Q_A.replace("base_model.model.", "")),
     r"its name lacks the 'base_model\.model\.' prefix .*PeftModel\.from_pretrained would not load it either"),
    (add(f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", torch.zeros(64)), r"it is a bias, which is not served"),
    (add("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 128)),
     rf"'base_model\.model\.model\.embed_tokens\.lora_embedding_A' {NOT_LORA}; {ONLY_PROJECTIONS}"),
    (add("base_model.model.model.norm.weight", torch.ones(64)), r"looks like a fully trained module"),
    (add(f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64)),
     r"tensor '.*layers\.2\.self_attn\.q_proj\.lora_A\.weight' is for layer 2, but the model has 2 layers \(0 to 1\)"),
    (lambda tensors: {n: t for n, t in tensors.items() if n != Q_B},
     rf"tensor '{Q_A}' has no lora_B beside it: each targeted projection needs both lora_A and lora_B"),
    (lambda tensors: {n: t for n, t in tensors.items() if n != Q_A}, rf"tensor '{Q_B}' has no lora_A beside it"),
    (lambda tensors: {n: t.to(torch.int8) if n == Q_A else t for n, t in tensors.items()}, r"is stored as I8"),
    (lambda tensors: {}, r"holds no LoRA weights"),
], ids=["unknown-suffix", "wrong-parent", "no-prefix", "bias", "embedding", "full-module", "layer-out-of-range",
        "A-without-B", "B-without-A", "integer", "empty"])
def test_tensors_that_are_not_lora_of_a_projection_are_refused(llama, tiny_adapter, tmp_path, tensors, pattern):
    refused(edited(tiny_adapter("r4"), tmp_path, tensors=tensors), llama[0], pattern)


def test_shapes_that_do_not_fit_the_model_name_the_tensor_and_both_shapes(llama, tiny_adapter, tiny_checkpoint,
                                                                          tmp_path):
    # an adapter for the tiny Qwen3, whose heads are 32 wide: its q_proj has 128 outputs, not 64
    refused(tiny_adapter("r4", "qwen3"), llama[0],
            rf"tensor '{Q_B}' has shape \[128, 4\], but the model's q_proj \(64 in, 64 out\) at rank 4 needs \[64, 4\]")
    wider = edited(tiny_adapter("r4"), tmp_path, tensors=lambda t: {**t, Q_A: torch.zeros(4, 65)})
    refused(wider, llama[0], rf"tensor '{Q_A}' has shape \[4, 65\], but .* needs \[4, 64\]")
    # a rank that disagrees with the config (PEFT's own load fails on it too)
    refused(edited(tiny_adapter("r4"), tmp_path / "r", {"r": 5}), llama[0],
            rf"'{PREFIX}\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \[4, 64\].* at rank 5 needs \[5, 64\].*"
            r"r / rank_pattern disagrees")


def test_non_finite_values_are_refused_at_load_only(llama, tiny_adapter, tmp_path):
    def poison(tensors):
        tensors[Q_B][3, 1] = float("nan")
        return tensors

    path = edited(tiny_adapter("r4"), tmp_path, tensors=poison)
    assert read_adapter(path, llama[0], MAX_RANK).rank == 4  # the header alone: no tensor is read
    with pytest.raises(ValueError, match=rf"tensor '{Q_B}' holds values that are not finite \(NaN or infinity\): "
                                         r"the adapter is damaged or its training diverged"):
        load_adapter(path, llama[0], MAX_RANK, torch.float32, TPShard.of(llama[0]))


def test_a_b_that_overflows_the_dtype_once_scaled_is_refused(llama, tiny_adapter, tmp_path):
    path = edited(tiny_adapter("r4"), tmp_path, tensors=lambda t: {**t, Q_B: torch.full((64, 4), 60000.0)})
    load_adapter(path, llama[0], MAX_RANK, torch.float32, TPShard.of(llama[0]))
    with pytest.raises(ValueError, match=rf"tensor '{Q_B}' holds values that are not finite .*: once scaled, it "
                                         r"overflows float16; serve the adapter in a wider dtype"):
        load_adapter(path, llama[0], MAX_RANK, torch.float16, TPShard.of(llama[0]))


# -- what is loaded ----------------------------------------------------------------------------------------------

def test_read_adapter_describes_the_adapter(llama, tiny_adapter):
    info = read_adapter(tiny_adapter("one-layer"), llama[0], MAX_RANK)
    stored = load_file(tiny_adapter("one-layer") / WEIGHTS_FILE)
    assert info == AdapterInfo(str(tiny_adapter("one-layer")), 4, 8, False, ("k_proj", "down_proj"), (1,),
                               sum(t.numel() * t.element_size() for t in stored.values()))
    info = read_adapter(tiny_adapter("r8-rslora"), llama[0], MAX_RANK)
    assert (info.rank, info.lora_alpha, info.use_rslora, info.projections, info.layers) == (8, 4, True, PROJECTIONS,
                                                                                           (0, 1))


@pytest.mark.parametrize("name", ["r4", "r2-attn", "r8-rslora", "patterns", "one-layer"])
def test_loaded_a_and_b_are_peft_s_own_times_its_scaling(llama, tiny_adapter, name):
    config, hf_model = llama
    path = tiny_adapter(name)
    peft = peft_lora_modules(hf_model, path)
    weights = load_adapter(path, config, MAX_RANK, torch.float32, TPShard.of(config))
    assert isinstance(weights, LoRAWeights) and weights.path == str(path)
    assert weights.rank == max(a.shape[0] for a, _, _ in peft.values())
    assert loaded_parts(weights) == set(peft)
    for (layer, projection), (a, b, scaling) in peft.items():
        ours_a, ours_b = part(weights, layer, projection)
        assert ours_a.dtype == ours_b.dtype == torch.float32
        assert torch.equal(ours_a, a), (layer, projection)
        assert torch.equal(ours_b, b * scaling), (layer, projection)
    assert weights.nbytes == sum((a.numel() + b.numel()) * 4 for a, b, _ in peft.values())
    if name == "patterns":  # PEFT did give these modules their own ranks and alphas
        ranks = peft[1, "q_proj"][0].shape[0], peft[0, "gate_proj"][0].shape[0], peft[1, "v_proj"][0].shape[0]
        assert ranks == (2, 6, 4)
        assert (peft[1, "v_proj"][2], peft[1, "down_proj"][2], peft[0, "up_proj"][2]) == (3 / 4, 12 / 4, 5 / 6)


def test_bfloat16_weights_are_the_float32_ones_rounded(llama, tiny_adapter):
    config = llama[0]
    full = load_adapter(tiny_adapter("r4"), config, MAX_RANK, torch.float32, TPShard.of(config))
    half = load_adapter(tiny_adapter("r4"), config, MAX_RANK, torch.bfloat16, TPShard.of(config))
    for key, parts in full.modules.items():
        for (a, b), (ha, hb) in zip(parts, half.modules[key]):
            assert ha.dtype == hb.dtype == torch.bfloat16
            assert torch.equal(ha, a.to(torch.bfloat16)) and torch.equal(hb, b.to(torch.bfloat16))


def test_untargeted_parts_are_none_and_untargeted_modules_absent(llama, tiny_adapter):
    weights = load_adapter(tiny_adapter("one-layer"), llama[0], MAX_RANK, torch.float32, TPShard.of(llama[0]))
    assert sorted(weights.modules) == [(1, "down_proj"), (1, "qkv_proj")]
    q, k, v = weights.modules[1, "qkv_proj"]
    assert q is None and v is None and k is not None


def loaded_parts(weights: LoRAWeights) -> set[tuple[int, str]]:
    return {(layer, p) for (layer, fused), parts in weights.modules.items()
            for p, ab in zip(FUSED_PARTS[fused], parts, strict=True) if ab is not None}


def part(weights: LoRAWeights, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
    fused = next(f for f, parts in FUSED_PARTS.items() if projection in parts)
    return weights.modules[layer, fused][FUSED_PARTS[fused].index(projection)]


def projection_weights(model, config) -> dict[str, torch.Tensor]:
    """The model's parameters by name, a fused qkv_proj or gate_up_proj (Phi-3's) also by the
    names of its parts."""
    params = dict(model.named_parameters())
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    for name, p in list(params.items()):
        for fused, sizes in (("qkv_proj", [q, kv, kv]), ("gate_up_proj", [inter, inter])):
            if f".{fused}." in name:
                params.update((name.replace(fused, part), t) for part, t in zip(FUSED_PARTS[fused], p.split(sizes)))
    return params


def assert_merges_like_peft(hf_model, config, path: Path) -> None:
    """Every projection's base weight plus B @ A from load_adapter equals PEFT's merged weight."""
    weights = load_adapter(path, config, 64, torch.float32, TPShard.of(config))
    merged = projection_weights(merged_reference(hf_model, path), config)
    base = projection_weights(hf_model, config)
    parts = loaded_parts(weights)
    assert parts, "the adapter targets nothing"
    for layer in range(config.num_layers):
        for projection in PROJECTIONS:
            parent = "self_attn" if projection in FUSED_PARTS["qkv_proj"] + FUSED_PARTS["o_proj"] else "mlp"
            name = f"model.layers.{layer}.{parent}.{projection}.weight"
            if (layer, projection) in parts:
                a, b = part(weights, layer, projection)
                torch.testing.assert_close(base[name] + b @ a, merged[name], msg=name)
                assert not torch.equal(merged[name], base[name]), name
            else:
                assert torch.equal(merged[name], base[name]), name


def test_merged_weights_equal_peft_s_merge_on_every_tiny_architecture(tiny_checkpoint, tiny_adapter, arch):
    """(On Phi-3, whose q/k/v and gate/up are one module each, these adapters adapt o_proj and
    down_proj only.)"""
    path, hf_model = tiny_checkpoint(arch)
    for name in ("r4", "patterns", "one-layer"):
        assert_merges_like_peft(hf_model, load_config(str(path)), tiny_adapter(name, arch))


def test_an_adapter_of_phi3_s_fused_projections_is_refused(tiny_checkpoint, tmp_path):
    path, hf_model = tiny_checkpoint("phi3")
    adapter = make_peft_adapter(hf_model, tmp_path / "fused", rank=4, alpha=8, targets=("qkv_proj", "gate_up_proj"),
                                seed=16)
    refused(adapter, load_config(str(path)), "qkv_proj")


@pytest.mark.parametrize("name", ["r16", "r4-qv"])  # (rsLoRA and patterns: on the tiny models above)
def test_merged_weights_equal_peft_s_merge_on_the_embedded_model(embedded_hf_model, embedded_adapter, name):
    assert_merges_like_peft(embedded_hf_model, load_config(), embedded_adapter(name))


# -- tensor parallelism ------------------------------------------------------------------------------------------

def assert_shards_make_the_whole(config, path: Path, size: int) -> None:
    """On a random x: column-parallel parts, each rank's x A^T B_r^T are the output columns its base
    weight holds (B_r: those rows of B, A whole), and together they are x A^T B^T (KV columns once
    per replica); row-parallel parts, the ranks' partial products x_r A_r^T B^T sum to x A^T B^T."""
    whole = load_adapter(path, config, MAX_RANK, torch.float32, TPShard.of(config))
    shards = [TPShard.of(config, rank, size) for rank in range(size)]
    loaded = [load_adapter(path, config, MAX_RANK, torch.float32, s) for s in shards]
    x = torch.randn(5, max(config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim),
                    generator=torch.Generator().manual_seed(0))
    for layer, projection in sorted(loaded_parts(whole)):
        a, b = part(whole, layer, projection)
        y = x[:, :a.shape[1]] @ a.T @ b.T
        pieces = [part(w, layer, projection) for w in loaded]
        if projection in ("o_proj", "down_proj"):
            columns = a.shape[1] // size
            assert all(torch.equal(pb, b) for _, pb in pieces)
            partial = sum(x[:, r * columns:(r + 1) * columns] @ pa.T @ pb.T for r, (pa, pb) in enumerate(pieces))
            torch.testing.assert_close(partial, y)
            continue
        assert all(torch.equal(pa, a) for pa, _ in pieces)
        outputs = {}
        for s, (pa, pb) in zip(shards, pieces):
            start = {"q_proj": s.rank * s.num_heads * config.head_dim, "k_proj": s.kv_head_start * config.head_dim,
                     "v_proj": s.kv_head_start * config.head_dim}.get(projection, s.rank * s.intermediate_size)
            assert torch.equal(pb, b[start:start + pb.shape[0]]), (layer, projection, s.rank)
            outputs[start] = x[:, :a.shape[1]] @ pa.T @ pb.T
        torch.testing.assert_close(torch.cat([outputs[s] for s in sorted(outputs)], dim=1), y)


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks outnumber the 2 KV heads: each is held twice
def test_tensor_parallel_shards_make_the_whole_delta(llama, tiny_adapter, size):
    for name in ("r4", "patterns"):
        assert_shards_make_the_whole(llama[0], tiny_adapter(name), size)


def test_tensor_parallel_shards_with_one_replicated_kv_head(odd_checkpoint, tmp_path):
    path, hf_model = odd_checkpoint  # 1 KV head, at 2 ranks held by both
    adapter = make_peft_adapter(hf_model, tmp_path / "odd", rank=4, alpha=8, seed=5)
    assert_shards_make_the_whole(load_config(str(path)), adapter, 2)


def test_tensor_parallel_shards_of_the_embedded_model(embedded_adapter):
    assert_shards_make_the_whole(load_config(), embedded_adapter("r8"), 3)


# -- identity ----------------------------------------------------------------------------------------------------

def test_adapter_identity_changes_when_a_file_does(tiny_adapter, tmp_path):
    path = edited(tiny_adapter("r4"), tmp_path)
    first = adapter_identity(path)
    assert adapter_identity(path) == first and len(first) == 16
    assert adapter_identity(tiny_adapter("r4")) != first  # another directory
    config = path / CONFIG_FILE
    stat = config.stat()
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 9'))  # same size,
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime
    assert adapter_identity(path) != first
    with pytest.raises(ValueError, match="does not exist"):
        adapter_identity(tmp_path / "nowhere")
