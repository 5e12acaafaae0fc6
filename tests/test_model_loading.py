"""config.json parsing, TP divisibility and checkpoint loading errors name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gpu_worker.runtime.loader import load_model
from gpu_worker.runtime.model_config import ModelConfig
from gpu_worker.runtime.parallel import TPGroup

BASE = {"model_type": "llama", "vocab_size": 131, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64}
CPU = TPGroup(0, 1, None, torch.device("cpu"))


def _write(tmp_path, **overrides) -> str:
    raw = {k: v for k, v in {**BASE, **overrides}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    out = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h),
           "model.norm.weight": torch.ones(h), "lm_head.weight": torch.randn(config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": torch.randn(config.num_heads * config.head_dim, h),
                p + "self_attn.k_proj.weight": torch.randn(kv, h),
                p + "self_attn.v_proj.weight": torch.randn(kv, h),
                p + "self_attn.o_proj.weight": torch.randn(h, config.num_heads * config.head_dim),
                p + "mlp.gate_proj.weight": torch.randn(config.intermediate_size, h),
                p + "mlp.up_proj.weight": torch.randn(config.intermediate_size, h),
                p + "mlp.down_proj.weight": torch.randn(h, config.intermediate_size),
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h)}
    return out


@pytest.mark.parametrize(("overrides", "named"), [
    ({"hidden_size": None}, "hidden_size"),
    ({"num_attention_heads": "4"}, "num_attention_heads"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "rope_scaling.low_freq_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.375}, "partial_rotary_factor"),
])
def test_model_config_error_names_the_bad_key(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        ModelConfig.from_dir(_write(tmp_path, **overrides))


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    model_dir = _write(tmp_path, model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    with pytest.raises(ValueError, match=r"architecture Gemma2ForCausalLM \(model_type 'gemma2'\)"
                                         r" is not supported .*Qwen3ForCausalLM"):
        load_model(model_dir, CPU, torch.float32, "cpu")


def test_model_config_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: cannot read"):
        ModelConfig.from_dir(tmp_path)


def test_model_config_reads_both_rope_layouts_alike(tmp_path):
    old = ModelConfig.from_dir(_write(tmp_path, rope_theta=5e5, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}))
    new = ModelConfig.from_dir(_write(tmp_path, rope_theta=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
        "original_max_position_embeddings": 32}))
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling["rope_type"] == "yarn"
    qwen = ModelConfig.from_dir(_write(tmp_path, model_type="qwen2"))
    assert qwen.attention_bias and qwen.rope_scaling is None and qwen.head_dim == 8
    assert qwen.sliding_window is None
    qwen3 = ModelConfig.from_dir(_write(tmp_path, model_type="qwen3", head_dim=16))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 16
    phi3 = ModelConfig.from_dir(_write(tmp_path, model_type="phi3", sliding_window=8,
                                       partial_rotary_factor=0.5))
    assert phi3.fused_projections and phi3.sliding_window == 8 and phi3.rotary_dim == 4


def test_model_check_tp_rejects_heads_that_do_not_shard():
    config = ModelConfig.from_dict(BASE)
    config.check_tp(2)  # vocab 131 is odd: padded shards, accepted
    with pytest.raises(ValueError, match="num_key_value_heads"):
        config.check_tp(4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        config.check_tp(3)
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict({**BASE, "num_key_value_heads": 4,
                               "intermediate_size": 66}).check_tp(4)
    with pytest.raises(ValueError, match="tp size"):
        config.check_tp(0)


def test_model_loader_names_a_missing_tensor(tmp_path):
    model_dir = _write(tmp_path)
    weights = _weights(ModelConfig.from_dir(model_dir))
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight is missing"):
        load_model(model_dir, CPU, torch.float32, "cpu")


def test_model_loader_names_a_tensor_of_the_wrong_shape(tmp_path):
    model_dir = _write(tmp_path)
    weights = _weights(ModelConfig.from_dir(model_dir))
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.randn(8, 32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"k_proj\.weight: checkpoint tensor has shape \(8, 32\)"):
        load_model(model_dir, CPU, torch.float32, "cpu")


def test_model_loader_without_weights_file_names_what_it_looked_for(tmp_path):
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(_write(tmp_path), CPU, torch.float32, "cpu")


def test_model_forward_rejects_a_sequence_past_the_cache(tmp_path):
    model_dir = _write(tmp_path)
    save_file(_weights(ModelConfig.from_dir(model_dir)), str(tmp_path / "model.safetensors"))
    model = load_model(model_dir, CPU, torch.float32, "cpu")
    from gpu_worker.runtime.model import ForwardBatch

    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model(ForwardBatch.build([0], [0], [[1, 2]], "cpu"))
    model.allocate_kv_cache(2, 8)
    with pytest.raises(ValueError, match="max_len 8"):
        model(ForwardBatch.build([0], [6], [[1, 2, 3]], "cpu"))
    with pytest.raises(ValueError, match="slot 2 does not exist"):
        model(ForwardBatch.build([2], [0], [[1]], "cpu"))
    with pytest.raises(ValueError, match="slots: a slot appears twice"):
        ForwardBatch.build([1, 1], [0, 0], [[1], [2]], "cpu")
    assert model(ForwardBatch.build([1], [0], [[1, 2, 3]], "cpu")).shape == (1, 131)
