"""Config sources: dict, JSON/HJSON files, base64; parse errors; the caller's dict is never modified."""

import base64
import copy
import json
import warnings

import pytest

from shardspeed.config import ConfigError, ShardspeedConfig, load_config

SIMPLE = {
    "train_batch_size": 8,
    "fp16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
}


def test_dict_is_not_mutated_and_raw_is_a_deep_copy():
    config = {
        "train_batch_size": 16,
        "zero_optimization": True,  # deprecated form: rewritten on a private copy only
        "bfloat16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}},
    }
    before = copy.deepcopy(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(config, world_size=2)
    assert config == before
    assert cfg.raw == before
    cfg.raw["optimizer"]["params"]["betas"].append(1)
    cfg.optimizer.params["betas"].append(2)
    assert config == before


def test_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SIMPLE))
    cfg = load_config(str(path))
    assert cfg.fp16.enabled and cfg.train_batch_size == 8
    assert load_config(path).optimizer.type == "Adam"  # os.PathLike works too


def test_hjson_file_with_comments(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        """
        // a DeepSpeed config with comments
        {
          "train_batch_size": 8,   # hash comments too
          /* block comment */
          "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,},
        }
        """
    )
    cfg = load_config(str(path))
    assert cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope" / "ds_config.json")
    with pytest.raises(ConfigError) as caught:
        load_config(missing)
    assert missing in str(caught.value)
    assert "not found" in str(caught.value)


def test_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="directory"):
        load_config(str(tmp_path))


def test_duplicate_key_is_named(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError, match="duplicate key 'enabled'"):
        load_config(str(path))


def test_invalid_json_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true\n}')
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    message = str(caught.value)
    assert "line" in message and "column" in message
    assert "bad.json" in message


@pytest.mark.parametrize("text", ["[1, 2, 3]", "42", '"hello"'])
def test_top_level_must_be_an_object(tmp_path, text):
    path = tmp_path / "list.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(str(path))


def test_base64_config():
    encoded = base64.urlsafe_b64encode(json.dumps(SIMPLE).encode()).decode()
    cfg = load_config(encoded)
    assert cfg.fp16.enabled and cfg.optimizer.params == {"lr": 1e-3}


def test_base64_of_hjson_with_comments():
    text = "{\n  # comment\n  train_micro_batch_size_per_gpu: 2\n}"
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    assert load_config(encoded, world_size=3).train_batch_size == 6


def test_garbage_string_is_refused():
    with pytest.raises(ConfigError, match="neither an existing file nor a urlsafe-base64"):
        load_config("notbase64atall")


def test_wrong_source_type_is_refused():
    with pytest.raises(ConfigError, match="expected a dict"):
        load_config(42)


def test_shardspeed_config_is_reresolved_for_a_new_world_size():
    cfg = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=2)
    again = load_config(cfg, world_size=4)
    assert isinstance(again, ShardspeedConfig)
    assert again.train_batch_size == 16 and cfg.train_batch_size == 8


def test_to_dict_is_json_serialisable_and_resolved():
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3}}, world_size=2)
    resolved = json.loads(json.dumps(cfg.to_dict()))
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["gradient_accumulation_steps"] == 1
    assert resolved["zero_optimization"]["overlap_comm"] is True
    assert resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert "raw" not in resolved
    # The resolved dict is itself a valid config.
    assert load_config(resolved, world_size=2).to_dict() == cfg.to_dict()
