"""AutoTP universal checkpoints, piece by piece (no processes): the per-parameter metadata AutoTP layers carry,
merging tensor slices by `universal_checkpoint_info` (checkpoint/tp_slices.py: in memory, over DeepSpeed's
fragment files, and a DeepSpeed ZeRO-3 + AutoTP grid), and cutting a rank's slice back by the metadata
(checkpoint/tp_restore.py). Cut and merge are checked as inverses on uneven (GQA) layouts."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from shardspeed.checkpoint import tp_restore, tp_slices
from shardspeed.module_inject.layers import (
    GateUpPackLinearLayer,
    LinearAllreduce,
    LinearLayer,
    SubParamLinearLayer,
    TPPartition,
    shard_tensor,
)
from shardspeed.module_inject.tp_state import universal_checkpoint_info
from shardspeed.module_inject.tp_uc_meta import AUTOTP_META_ATTR, subparam_shard_widths

# a fused GQA projection: 6 query rows, 3 key and 3 value rows, over 2 ranks: each part split 2/1 unevenly
SIZES, WIDTHS = (6, 3, 3), [[4, 2], [2, 1], [2, 1]]


def _cut_by_widths(full: torch.Tensor, rank: int) -> torch.Tensor:
    return tp_restore.narrow_sub_params(full, 0, SIZES, WIDTHS, rank, 2, 0.4).view(-1, *full.shape[1:])


def _info(pattern: str, shape) -> dict:
    return {
        "universal_checkpoint_version": 0.4,
        "parameter_with_sub_params": [{"patterns": [pattern], "shape": shape, "partition_dim": 0}],
        "sub_param_shard_widths": {pattern: WIDTHS},
    }


def test_uneven_fused_cut_and_merge_are_inverses():
    full = torch.arange(24.0).view(12, 2)
    slices = [_cut_by_widths(full, r) for r in range(2)]
    assert [s.shape[0] for s in slices] == [8, 4]
    # rank 0 holds q rows 0-3, k rows 6-7, v rows 9-10: its piece of every part, in part order
    assert slices[0][:, 0].tolist() == [0, 2, 4, 6, 12, 14, 18, 20]
    merged, extra = tp_slices.merge_rank_slices(_info(r"^qkv$", [SIZES, 2]), "qkv", slices, 2)
    assert torch.equal(merged, full) and extra["sub_param_shape"].partition_dim == 0


def test_merge_rules_row_replicated_vocabulary_and_refusals():
    a, b = torch.ones(4, 3), torch.zeros(4, 2)
    info = {"parameter_with_row_parallelism_patterns": [r"^o$"], "tp_replicated_parameter_patterns": [r"^n$"],
            "vocabulary_parameter_patterns": [r"^emb$"], "original_vocab_size": 5}  # fmt: skip
    merged, extra = tp_slices.merge_rank_slices(info, "o", [a, b], 2)
    assert merged.shape == (4, 5) and extra == {"cat_dim": 1}
    assert torch.equal(tp_slices.merge_rank_slices(info, "n", [a, a.clone()], 2)[0], a)
    with pytest.raises(AssertionError, match="differ"):
        tp_slices.merge_rank_slices(info, "n", [a, a + 1], 2)
    vocab, extra = tp_slices.merge_rank_slices(info, "emb", [torch.ones(3, 2), torch.ones(3, 2)], 2)
    assert vocab.shape == (5, 2) and extra["vocab_tensor"]  # the padding row is cut off
    no_widths = _info(r"^qkv$", [SIZES, 2])
    del no_widths["sub_param_shard_widths"]
    with pytest.raises(AssertionError, match="records no sub_param_shard_widths"):
        tp_slices.merge_rank_slices(no_widths, "qkv", [torch.zeros(8, 2), torch.zeros(4, 2)], 2)
    # DeepSpeed's affine map beside the lists: one block per rank is what the lists say; several pieces of a
    # parameter the lists do not describe as fused are refused
    one_block = {"ranks": {0: {"pieces": [{}]}, 1: {"pieces": [{}]}}}
    mapped = {
        **info,
        "affine_map": {
            "version": 1,
            "params": {r"^o$": one_block, r"^x$": {"ranks": {0: {"pieces": [{}, {}]}}}},
        },
    }
    assert tp_slices.merge_rank_slices(mapped, "o", [a, b], 2)[0].shape == (4, 5)
    with pytest.raises(ValueError, match="affine_map"):
        tp_slices.merge_rank_slices(mapped, "x", [a, a], 2)


def _fragments(root, name, rank, value, dp=2):
    """DeepSpeed's extracted fragments of one tensor rank: `<name>/<rank>/<state>.<dp>`, split over dp."""
    folder = root / name / str(rank)
    folder.mkdir(parents=True)
    for state, scale in (("fp32", 1), ("exp_avg", 10), ("exp_avg_sq", 100)):
        for d, piece in enumerate((value.reshape(-1) * scale).tensor_split(dp)):
            torch.save(piece.clone(), folder / f"{state}.{d:02d}")
    torch.save(7, folder / "step.00")


def test_merge_tp_slices_over_fragment_files(tmp_path):
    full = torch.arange(24.0).view(12, 2)
    for rank in range(2):
        _fragments(tmp_path / "slices", "qkv", rank, _cut_by_widths(full, rank))
    shapes = [torch.Size([8, 2]), torch.Size([4, 2])]
    unmatched = tp_slices.merge_tp_slices(_info(r"^qkv$", [SIZES, -1]), tmp_path / "out", tmp_path / "slices", 2,
                                          ("qkv", shapes))  # fmt: skip
    assert unmatched == set()
    for state, scale in (("fp32", 1), ("exp_avg", 10), ("exp_avg_sq", 100)):
        written = torch.load(tmp_path / "out" / "qkv" / f"{state}.pt", weights_only=False)  # a SubparamShape
        assert torch.equal(written["param"], full * scale) and written["sub_param_shape"].shape == [SIZES, -1]
    assert torch.load(tmp_path / "out" / "qkv" / "step.pt") == 7
    # a rank that wrote nothing: an empty recorded shape stands in, a non-empty one means lost fragments
    _fragments(tmp_path / "one", "w", 0, torch.ones(4, 2))
    slices = tp_slices.merge_zero_shards(tmp_path / "one" / "w", "fp32", 2, [(4, 2), (0, 2)])
    assert [tuple(s.shape) for s in slices] == [(4, 2), (0, 2)]
    with pytest.raises(AssertionError, match="not empty"):
        tp_slices.merge_zero_shards(tmp_path / "one" / "w", "fp32", 2, [(4, 2), (4, 2)])


def test_group_per_tp_shapes_is_pipeline_major():
    files = [{"a": (3, 4), "s0": (1,)}, {"a": (2, 4), "s0": (1,)}, {"a": (3, 4), "s1": (2,)}, {"a": (2, 4)}]
    grouped = tp_slices.group_per_tp_shapes(files, pp_degree=2, tp_degree=2)
    assert grouped == {"a": [(3, 4), (2, 4)], "s0": [(1,), (1,)], "s1": [(2,), None]}
    with pytest.raises(AssertionError, match="disagree"):
        tp_slices.group_per_tp_shapes([{"t": (1,)}, {"t": (1,)}, {"t": (2,)}, {"t": (1,)}], 2, 2)


def test_restore_by_metadata_partition_sizes_replicated_and_refusals():
    full = torch.arange(20.0).view(10, 2)
    param = nn.Parameter(torch.zeros(2, 2))
    meta = {"partition_dim": 0, "logical_shape": (10, 2), "partition_sizes": (3, 3, 2, 2)}
    setattr(param, AUTOTP_META_ATTR, meta)
    assert torch.equal(tp_restore.resolve_autotp_partition(param, {}, full, 3, 4), full[8:].flatten())
    meta["partition_sizes"] = None  # 10 over 4 is uneven: an even chunk would guess wrong, so it is refused
    with pytest.raises(AssertionError, match="records no partition_sizes"):
        tp_restore.resolve_autotp_partition(param, {}, full, 3, 4)
    setattr(param, AUTOTP_META_ATTR, {"replicated": True, "partition_dim": None})
    assert torch.equal(tp_restore.resolve_autotp_partition(param, {}, full, 1, 4), full.flatten())
    setattr(
        param, AUTOTP_META_ATTR, {"partition_dim": 0, "conversion": {"unsupported_reason": "interleaved"}}
    )
    with pytest.raises(RuntimeError, match="interleaved"):
        tp_restore.resolve_autotp_partition(param, {}, full, 0, 2)
    with pytest.raises(AssertionError, match="not divisible"):  # legacy metadata cannot describe 3 over 2
        tp_restore.narrow_sub_params(full.view(10, 2), 0, (4, 3, 3), None, 0, 2, 0.3)


class _Address:
    def __init__(self, start, numel):
        self.start, self.numel = start, numel


class _Mapping:
    """DeepSpeed's high-precision mapping of a ZeRO partition: elements [start, start + numel) of the slice."""

    def __init__(self, hp, start):
        self.hp, self.lp_fragment_address, self.optim_fragment = hp, _Address(start, hp.numel()), {}

    def get_hp_fragment(self):
        return self.hp


def test_load_hp_checkpoint_state_fills_this_partitions_fragment(tmp_path):
    full = torch.arange(24.0).view(12, 2)
    torch.save({"param": full}, tmp_path / "fp32.pt")
    torch.save({"param": full * 10}, tmp_path / "exp_avg.pt")
    torch.save(torch.tensor(5.0), tmp_path / "step.pt")
    param = nn.Parameter(torch.zeros(4, 2))  # rank 1's slice, of which this partition holds elements 2..7
    setattr(param, AUTOTP_META_ATTR, {"universal_checkpoint_version": 0.4, "partition_dim": 0,
                                      "logical_shape": (12, 2), "sub_param_sizes": SIZES,
                                      "sub_param_shard_widths": WIDTHS})  # fmt: skip
    hp = torch.zeros(6)
    param._hp_mapping = _Mapping(hp, 2)
    param.load_hp_checkpoint_state = types.MethodType(tp_restore.load_hp_checkpoint_state, param)
    step = param.load_hp_checkpoint_state(str(tmp_path), tp_rank=1, tp_world_size=2)
    rank1 = _cut_by_widths(full, 1).flatten()
    assert step == 5.0 and torch.equal(hp, rank1[2:8])
    assert torch.equal(param._hp_mapping.optim_fragment["exp_avg"], rank1[2:8] * 10)
    with pytest.raises(AttributeError, match="_hp_mapping"):
        tp_restore.load_hp_checkpoint_state(nn.Parameter(torch.zeros(1)), str(tmp_path), 0, 1)


def _layer_at(layer, tp: int, rank: int):
    """Stand `layer` (built at one rank) in for rank `rank` of `tp`: its frozen split and this rank's shards."""
    full_w = layer.weight.detach().clone()
    full_b = layer.bias.detach().clone() if layer.bias is not None else None
    layer.tp_world_size = tp
    layer._freeze_partition_sizes(full_w.shape[layer.partition_dim])
    segments = layer._subparam_sizes or (full_w.shape[layer.partition_dim],)
    layer.weight.data = shard_tensor(
        full_w, TPPartition(layer.partition_dim, tuple(segments), tp), rank
    ).clone()
    if full_b is not None and isinstance(layer, LinearLayer):
        layer.bias.data = shard_tensor(full_b, TPPartition(0, tuple(segments), tp), rank).clone()
    layer._mark_uc_metadata()
    return full_w, full_b


@pytest.mark.parametrize("rank", [0, 1])
def test_layer_metadata_restores_exactly_the_layers_own_shards(rank):
    torch.manual_seed(0)
    fused = SubParamLinearLayer(nn.Linear(4, 16), None, shape=((8, 4, 4), -1), partition_dim=0, name="qkv")
    full_w, full_b = _layer_at(fused, 2, rank)
    meta = getattr(fused.weight, AUTOTP_META_ATTR)
    assert meta["sub_param_sizes"] == (8, 4, 4) and meta["sub_param_shard_widths"] == [[4, 4], [2, 2], [2, 2]]
    assert meta["target_partition_shape"] == (8, 4) and meta["original_shape"] == (16, 4)
    for param, full in ((fused.weight, full_w), (fused.bias, full_b)):
        cut = tp_restore.resolve_autotp_partition(param, {}, full, rank, 2)
        assert torch.equal(cut, param.detach().flatten())
    row = LinearAllreduce(nn.Linear(6, 4), None, name="o")
    full_w, full_b = _layer_at(row, 2, rank)
    assert torch.equal(tp_restore.resolve_autotp_partition(row.weight, {}, full_w, rank, 2),
                       row.weight.detach().flatten())  # fmt: skip
    assert getattr(row.bias, AUTOTP_META_ATTR)["replicated"]


def test_universal_checkpoint_info_publishes_sizes_and_widths():
    model = nn.Module()
    model.qkv = SubParamLinearLayer(nn.Linear(2, 12), None, shape=(3, -1), partition_dim=0)
    model.mlp = GateUpPackLinearLayer(nn.Linear(4, 12, bias=False), None)
    model.o = LinearAllreduce(nn.Linear(12, 2), None)
    model.norm = nn.LayerNorm(2)
    model.qkv.tp_world_size = model.mlp.tp_world_size = 2
    model.qkv._freeze_partition_sizes(12)
    model.mlp._freeze_partition_sizes(12)
    info = universal_checkpoint_info(model)
    entries = {e["patterns"][0]: e for e in info["parameter_with_sub_params"]}
    # the count 3 of the (3, -1) spec is published as the parts' sizes, which cannot be read as a width
    assert entries[r"^qkv\.weight$"]["shape"] == [(4, 4, 4), -1]
    assert entries[r"^mlp\.weight$"]["shape"] == [(6, 6), 4]
    assert info["sub_param_shard_widths"][r"^mlp\.weight$"] == [[3, 3], [3, 3]]
    assert info["parameter_with_row_parallelism_patterns"] == [r"^o\.weight$"]
    assert info["tp_replicated_parameter_patterns"] == [r"^norm\.bias$", r"^norm\.weight$", r"^o\.bias$"]
    assert subparam_shard_widths((8, 2, 2), 4) == [[2, 2, 2, 2], [1, 1, 0, 0], [1, 1, 0, 0]]


def test_zero3_partitioned_module_keeps_its_parameters_at_one_rank():
    module = nn.Linear(16, 8)
    for param in (module.weight, module.bias):
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    layer = LinearLayer(module, None)
    assert layer.weight is module.weight and (layer.in_features, layer.out_features) == (16, 8)
    assert getattr(layer.weight, AUTOTP_META_ATTR)["original_shape"] == (8, 16)


def _write_zero3_grid(folder, shards: dict, dp: int, info: dict):
    """A DeepSpeed ZeRO-3 + AutoTP checkpoint: per (tp, dp) rank, ZeRO-3's piece of each of the tensor rank's
    shards (ceil(numel / dp) elements, the last zero-padded), concatenated in order."""
    names = list(shards)
    for tp in range(len(shards[names[0]])):
        pieces = []
        for name in names:
            flat = shards[name][tp].reshape(-1)
            chunk = -(-flat.numel() // dp)
            pieces.append(torch.cat([flat, flat.new_zeros(chunk * dp - flat.numel())]).view(dp, chunk))
        shapes = [{name: list(shards[name][tp].shape) for name in names}]
        for d in range(dp):
            part = torch.cat([p[d] for p in pieces])
            osd = {"optimizer_state_dict": {"state": {0: {"exp_avg": part * 10, "step": torch.tensor(3.0)}},
                                            "param_groups": [{"lr": 0.1}]},
                   "fp32_flat_groups": [part], "zero_stage": 3}  # fmt: skip
            stem = folder / f"zero_pp_rank_{d}_mp_rank_{tp:02d}"
            torch.save({"param_shapes": shapes, "universal_checkpoint_info": info}, f"{stem}_model_states.pt")
            torch.save({"optimizer_state_dict": osd}, f"{stem}_optim_states.pt")


def test_deepspeed_zero3_autotp_checkpoint_converts(tmp_path):
    from shardspeed.checkpoint import to_universal

    qkv, o, norm = torch.arange(24.0).view(12, 2), torch.arange(15.0).view(3, 5), torch.tensor([1.0, 2.0])
    info = {**_info(r"^qkv$", [SIZES, -1]), "parameter_with_row_parallelism_patterns": [r"^o$"],
            "tp_replicated_parameter_patterns": [r"^norm$"]}  # fmt: skip
    shards = {
        "qkv": [_cut_by_widths(qkv, r) for r in range(2)],
        "o": [o[:, :3], o[:, 3:]],
        "norm": [norm, norm],
    }
    source = tmp_path / "ckpt" / "step3"
    source.mkdir(parents=True)
    _write_zero3_grid(source, shards, dp=2, info=info)
    out = tmp_path / "ckpt" / "step3_universal"
    to_universal.main(types.SimpleNamespace(input_folder=str(source), output_folder=str(out)))
    for name, whole in (("qkv", qkv), ("o", o), ("norm", norm)):
        assert torch.equal(torch.load(out / "zero" / name / "fp32.pt")["param"], whole)
        assert torch.equal(torch.load(out / "zero" / name / "exp_avg.pt")["param"], whole * 10)
        assert float(torch.load(out / "zero" / name / "step.pt")) == 3.0
    assert (tmp_path / "ckpt" / "latest_universal").read_text().strip() == "step3_universal"
    info["autotp_unsupported_parameter_patterns"] = {r"^qkv$": "interleaved heads"}
    _write_zero3_grid(source, shards, dp=2, info=info)
    with pytest.raises(ValueError, match="interleaved heads"):
        to_universal.main(types.SimpleNamespace(input_folder=str(source), output_folder=str(out)))


def test_deepspeed_optimizer_names_bind_the_per_parameter_loader():
    from shardspeed.compat.mirrors.optimizer_classes import ZeroStage12Optimizer

    param = nn.Parameter(torch.zeros(2))
    param.universal_checkpoint_info = {"universal_checkpoint_version": 0.4}
    optimizer = object.__new__(ZeroStage12Optimizer)
    optimizer.bit16_groups = [[param]]
    optimizer._enable_universal_checkpoint()
    del param.universal_checkpoint_info
    assert optimizer._get_universal_checkpoint_info() == {"universal_checkpoint_version": 0.4}
    assert param.load_hp_checkpoint_state.__func__ is tp_restore.load_hp_checkpoint_state
