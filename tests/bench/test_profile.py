"""The profile bench's machinery on a tiny model: the parts of a step add up to the step, the
model's matmul parameters are counted once each, and the report renders. (No timing is asserted.)"""

import pytest

from pagedserve.bench.profile import PARTS, format_table, matmul_ceiling, matmul_params, plot, profile_decode
from pagedserve.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, embedded_tokenizer):
    return load_model(str(tiny_checkpoint("llama")[0])), embedded_tokenizer


def test_a_decode_step_splits_into_parts(tiny):
    model, tokenizer = tiny
    profile = profile_decode(model, tokenizer, batch=3, steps=4, prompt_len=(4, 40), vocab=range(3, 120))
    assert profile.batch == 3 and profile.mean_context > 1
    assert set(profile.parts_s) == {*PARTS, "collectives"} and all(v >= 0 for v in profile.parts_s.values())
    # Medians of parts need not add up exactly, but the model's share cannot exceed the step.
    assert profile.parts_s["forward"] + profile.parts_s["logits"] <= profile.step_s
    assert profile.parts_s["broadcast"] == profile.parts_s["collectives"] == 0.0  # one process


@pytest.mark.tp
def test_tensor_parallel_steps_show_the_broadcast_and_the_collectives(tiny_checkpoint, embedded_tokenizer):
    profile = profile_decode(None, embedded_tokenizer, batch=3, steps=4, tensor_parallel_size=2,
                             model_path=str(tiny_checkpoint("llama")[0]), prompt_len=(4, 40), vocab=range(3, 120))
    assert 0 < profile.parts_s["broadcast"] < profile.step_s
    # Each step's collectives lie within that step, so their median cannot pass the steps' median.
    # (Not within median forward + median logits: medians of separate parts need not add up, and a
    # full-suite run failed that way, collectives 9.95 ms against forward 9.00 + logits 0.41.)
    assert 0 < profile.parts_s["collectives"] < profile.step_s


def test_matmul_parameters_of_the_embedded_model(embedded_model):
    net, config = embedded_model
    # 30 layers of (q, k, v, o, gate, up, down) + the tied LM head: SmolLM2's 134.5M in all.
    per_layer = 576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536
    assert matmul_params(net) == 30 * per_layer + 49152 * 576
    assert matmul_params(net) == sum(p.numel() for p in net.parameters()) - (30 * 2 + 1) * 576


def test_report_renders(tiny, tmp_path):
    model, _ = tiny
    net = model[0]
    rate = matmul_ceiling(net, tokens=8, reps=1)
    report = {"threads": 2, "matmul_gflops": rate / 1e9, "flops_per_token": 2 * matmul_params(net),
              "ceiling_tokens_per_s": rate / (2 * matmul_params(net)),
              "steps": [{"batch": 4, "mean_context": 50.0, "step_s": 0.1, "tokens_per_s": 40.0, "outside_share": 0.05,
                         "parts_s": {p: 0.1 / len(PARTS) for p in PARTS}}]}
    table = format_table(report)
    assert "| 4 | 50 | 100.0 | 40.0 |" in table
    plot(report, str(tmp_path / "profile.png"))
    assert (tmp_path / "profile.png").stat().st_size > 0
