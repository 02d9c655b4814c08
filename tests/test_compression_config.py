"""`compression_training` config checks and init_compression errors: each names the key or module at fault."""

import pytest
from compression_common import Bert, group, technique, weight_technique

from shardspeed.compression.compress import init_compression
from shardspeed.compression.config import get_compression_config
from shardspeed.config import ConfigError, load_config

WQ_GROUP = {"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["query"]}}

BAD = [  # (compression_training, the message must contain)
    ({"sparse_pruning": {"shared_parameters": {"enabled": True, "method": "snip_momentum"}}},
     'sparse_pruning.shared_parameters.method: "snip_momentum" runs Intel Neural Compressor'),
    ({"sparse_pruning": {"shared_parameters": {"method": "l1", "block_pattern": "4x1"}}},
     "sparse_pruning.shared_parameters.block_pattern: only method snip_momentum reads it"),
    ({"sparse_pruning": {"shared_parameters": {"schedule_offset": 5, "schedule_offset_end": 2}}},
     "schedule_offset_end: 2 is before schedule_offset 5"),
    ({"sparse_pruning": {"shared_parameters": {"method": "random"}}},
     "sparse_pruning.shared_parameters.method: must be one of 'l1', 'topk', 'snip_momentum'"),
    ({"weight_quantization": {"shared_parameters": {"enabled": True}}},
     "weight_quantization.different_groups: weight_quantization is enabled but no group is given"),
    ({"weight_quantization": {"shared_parameters": {"enabled": True, "quantization_type": "asymmetric"},
                              "different_groups": {"t": {"params": {"start_bits": 4, "target_bits": 2}}}}},
     "different_groups.t.params.target_bits: 2-bit weights are symmetric"),
    ({"weight_quantization": {"shared_parameters": {"rounding": "stochastic"},
                              "different_groups": {"b": {"params": {"start_bits": 1, "target_bits": 1}}}}},
     'different_groups.b.params.target_bits: 1-bit weights take no rounding mode'),
    ({"weight_quantization": {"different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}}}},
     "different_groups.g.params.start_bits: 4 is below target_bits 8"),
    ({"weight_quantization": {"different_groups": {"g": {"params": {"target_bits": 8}}}}},
     "different_groups.g.params.start_bits: required key missing"),
    ({"weight_quantization": {"different_groups": {"g": {"modules": ["q"]}}}},
     "different_groups.g.params: required key missing"),
    ({"weight_quantization": {"shared_parameters": {"enabled": True},
                              "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}}}}},
     "weight_quantization.shared_parameters.quantize_weight_in_forward: false quantizes through DeepSpeed's MoQ"),
    ({"weight_quantization": {"shared_parameters": {"quantize_groups": 0}}},
     "weight_quantization.shared_parameters.quantize_groups: must be > 0, got 0"),
    ({"activation_quantization": {"different_groups": {"a": {"params": {"bits": 6}}}}},
     "different_groups.a.params.bits: must be one of 4, 8, got 6"),
    ({"row_pruning": {"different_groups": {"r": {"params": {"dense_ratio": 0}}}}},
     "different_groups.r.params.dense_ratio: must be > 0, got 0"),
    ({"row_pruning": {"different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": "dense"}}}},
     'different_groups.r.modules: expected a list of (a string), got "dense"'),
    ({"row_pruning": {"different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["a", "b"],
                                                 "related_modules": [["c"]]}}}},
     "different_groups.r.related_modules: 1 list(s) for 2 'modules' entries"),
    ({"row_pruning": {"different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["(dense"]}}}},
     'different_groups.r.modules[0]: "(dense" is not a regular expression'),
    ({"head_pruning": {"shared_parameters": {"enabled": True}}},
     "head_pruning.shared_parameters.num_heads: required when head pruning is enabled"),
    ({"layer_reduction": {"enabled": True, "teacher_layer": [0]}},
     "layer_reduction.module_name_prefix: required when layer reduction is enabled"),
    ({"layer_reduction": {"enabled": True, "module_name_prefix": "layer", "teacher_layer": [0, 2],
                          "keep_number_layer": 3}},
     "layer_reduction.keep_number_layer: 3 but teacher_layer names 2 layers"),
    ({"channel_pruning": {"shared_parameters": {"enabeld": True}}},
     "unknown key 'compression_training.channel_pruning.shared_parameters.enabeld'; did you mean "
     "'compression_training.channel_pruning.shared_parameters.enabled'?"),
]  # fmt: skip


@pytest.mark.parametrize("block,message", BAD)
def test_bad_compression_config_names_the_key(block, message):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 1, "compression_training": block})
    assert message in str(err.value)
    assert "compression_training." in str(err.value)


def test_defaults_and_deepspeed_dict_view():
    cfg = load_config({"train_batch_size": 1, "compression_training": {
        "sparse_pruning": technique({"method": "topk", "schedule_offset": 7}, sp=group({"dense_ratio": 0.5}, ["q"]))
    }}).compression_training  # fmt: skip
    assert cfg.sparse_pruning.shared_parameters.schedule_offset_end == 7  # 0.18.9 leaves it unset: KeyError
    assert cfg.weight_quantization.shared_parameters.schedule_offset == 0
    assert cfg.activation_quantization.shared_parameters.schedule_offset == 1000
    assert cfg.head_pruning.shared_parameters.method == "topk"
    assert cfg.enabled_techniques() == ["sparse_pruning"]
    view = get_compression_config({"compression_training": {}})
    assert view["weight_quantization"]["shared_parameters"]["quantize_groups"] == 1
    assert view["layer_reduction"]["enabled"] is False


def _init_error(compression, model=None) -> str:
    with pytest.raises(ValueError) as err:
        init_compression(model or Bert(), {"compression_training": compression})
    return str(err.value)


def test_init_compression_errors_name_the_module_or_key():
    assert (
        "different_groups.g.modules[0]: 'nothing' matches no Linear/Conv2d/Embedding module"
        in _init_error(
            {
                "weight_quantization": weight_technique(
                    {}, g=group({"start_bits": 8, "target_bits": 8}, ["nothing"])
                )
            }
        )
    )
    assert "module layer.0.attention.self.query is matched by group 'b'" in _init_error(
        {
            "sparse_pruning": technique(
                {"method": "l1"},
                a=group({"dense_ratio": 0.5}, ["query"]),
                b=group({"dense_ratio": 0.5}, ["self"]),
            )
        }
    )
    assert (
        "quantize_groups: 3 does not divide the 1024 weights of layer.0.attention.self.query"
        in _init_error(
            {
                "weight_quantization": weight_technique(
                    {"quantize_groups": 3}, g=group({"start_bits": 8, "target_bits": 8}, ["query"])
                )
            }
        )
    )
    tied = Bert()
    tied.classifier.weight = tied.embeddings.weight
    assert "classifier.weight is tied to embeddings.weight" in _init_error(
        {
            "weight_quantization": weight_technique(
                {}, g=group({"start_bits": 8, "target_bits": 8}, ["classifier"])
            )
        },
        tied,
    )
    assert (
        "related_modules[0][0]: 'layer.0.output.dense' matches 1 modules but modules[0] matches 2"
        in _init_error(
            {
                "row_pruning": technique(
                    {}, r=group({"dense_ratio": 0.5}, ["intermediate"], [[r"layer.0.output.dense"]])
                )
            }
        )
    )
