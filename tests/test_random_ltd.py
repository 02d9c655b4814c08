"""Random-LTD on one process: the schedule's values, the wrapper running its layer on the kept tokens only
(dropped tokens pass through, gradients flow as through the unwrapped computation, masks cut as DeepSpeed cuts
them), and the DeepSpeed paths (`runtime.data_pipeline.data_routing`, `ops.random_ltd.dropping_utils`) naming
these objects. In the engine, on 2 ranks: test_data_efficiency_engine.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.config import load_config
from shardspeed.data_pipeline import RandomLayerTokenDrop, RandomLTDScheduler, remove_random_ltd_state_dict
from shardspeed.data_pipeline.random_ltd.tokens import bert_sample_tokens, gather_tokens, scatter_tokens

RANDOM_LTD = {"enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [0],
              "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
              "random_ltd_schedule": {"min_value": 4, "max_value": 10, "schedule_type": "fixed_linear",
                                      "schedule_config": {"require_steps": 3, "seq_per_step": 2}}}  # fmt: skip


def _block(**changes):
    config = {"train_batch_size": 2, "data_efficiency": {"enabled": True, "data_routing": {
        "enabled": True, "random_ltd": {**RANDOM_LTD, **changes}}}}  # fmt: skip
    return load_config(config, world_size=1).data_efficiency.data_routing.random_ltd


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.calls = []

    def forward(self, hidden, attention_mask=None):
        self.calls.append((hidden.detach().clone(), attention_mask))
        return hidden * self.scale


def _wrapped(**changes):
    block = _block(**changes)
    scheduler = RandomLTDScheduler(block, global_batch_size=2)
    layer = RandomLayerTokenDrop(Recorder())
    layer.init_config(block, scheduler, 0)
    return layer, scheduler


def test_schedule_values_and_consumed_layer_tokens():
    scheduler = RandomLTDScheduler(_block(), global_batch_size=2)
    kept = []
    for step in range(5):
        scheduler.update_seq(step)
        scheduler.update_seq(step)  # a second forward of the same step (accumulation) counts nothing more
        kept.append(scheduler.get_current_seq())
    # DeepSpeed's fixed_linear: floor(step / 3 * (10 - 4) + 4), down to a multiple of 2, at most 10
    assert kept == [4, 6, 8, 10, 10]
    # per step: global batch 2 x (kept x 1 dropping layer + 10 x 1 other layer)
    assert scheduler.state["consumed_layer_tokens"] == sum(2 * (k + 10) for k in kept)
    restored = RandomLTDScheduler(_block(), global_batch_size=2)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.state_dict() == scheduler.state_dict()


def test_kept_tokens_go_through_the_layer_and_the_rest_pass_through():
    layer, scheduler = _wrapped()
    scheduler.update_seq(0)  # keeps 4 of 10
    x = torch.arange(2 * 10 * 3, dtype=torch.float32).reshape(2, 10, 3).requires_grad_()
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
    out = layer(x, attention_mask=mask)
    kept = scheduler.state["sample_idx"][0]  # [batch, kept], sorted
    seen, seen_mask = layer.random_ltd_layer.calls[-1]
    assert kept.shape == (2, 4) and bool((kept.diff(dim=1) > 0).all())
    assert torch.equal(seen, torch.stack([x[b, kept[b]] for b in range(2)]).detach())
    assert torch.equal(seen_mask, mask[:, :, :4, :4])  # the decoder's causal mask, cut to the kept length
    for b in range(2):
        dropped = [i for i in range(10) if i not in kept[b].tolist()]
        assert torch.equal(out[b, kept[b]], 2 * x[b, kept[b]]) and torch.equal(out[b, dropped], x[b, dropped])
    # gradients: x2 through the layer at kept positions, identity elsewhere; the layer's own parameter too
    out.sum().backward()
    expected = torch.ones_like(x)
    for b in range(2):
        expected[b, kept[b]] = 2.0
    assert torch.equal(x.grad, expected)
    assert layer.random_ltd_layer.scale.grad == sum(x[b, kept[b]].sum() for b in range(2))


def test_full_length_eval_and_seq_batch_order():
    layer, scheduler = _wrapped(hidden_state_order="seq_batch_dim")
    x = torch.randn(10, 2, 3)  # [seq, batch, hidden]
    scheduler.update_seq(0)
    assert layer(x).shape == (10, 2, 3) and layer.random_ltd_layer.calls[-1][0].shape == (4, 2, 3)
    layer.eval()  # evaluation runs the whole sequence
    assert torch.equal(layer(x), 2 * x)
    layer.train()
    scheduler.update_seq(5)  # the schedule reached max_value: nothing is dropped
    assert scheduler.get_current_seq() == 10 and torch.equal(layer(x), 2 * x)


def test_encoder_masks_are_gathered_per_layer():
    mask = torch.arange(2 * 1 * 6 * 6).reshape(2, 1, 6, 6)
    indices, masks = bert_sample_tokens(3, 6, 2, layers=2, attn_mask=mask)
    assert indices.shape == (2, 2, 3) and len(masks) == 2
    for layer in range(2):
        for b in range(2):
            rows = indices[layer, b]
            assert torch.equal(masks[layer][b, 0], mask[b, 0][rows][:, rows])


def test_gather_and_scatter_are_inverse_on_the_kept_positions():
    hidden = torch.randn(3, 7, 4)
    indices = torch.tensor([[0, 2, 6], [1, 2, 3], [4, 5, 6]])
    kept = gather_tokens(hidden, indices, batch_first=True)
    assert torch.equal(scatter_tokens(hidden, kept, indices, batch_first=True), hidden)


def test_tuple_outputs_keep_their_other_elements():
    class Pair(nn.Module):
        def forward(self, hidden, attention_mask=None):
            return hidden + 1, "extra"

    block = _block()
    scheduler = RandomLTDScheduler(block, global_batch_size=2)
    layer = RandomLayerTokenDrop(Pair())
    layer.init_config(block, scheduler, 0)
    scheduler.update_seq(0)
    out, extra = layer(torch.zeros(2, 10, 3))
    assert extra == "extra" and out.sum() == 2 * 4 * 3


def test_state_dict_names_without_the_wrapper():
    model = nn.Sequential(RandomLayerTokenDrop(nn.Linear(2, 2)))
    assert set(remove_random_ltd_state_dict(model.state_dict())) == {"0.weight", "0.bias"}


def test_layer_token_lr_schedule_and_unknown_keys_are_refused():
    from shardspeed.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"random_ltd\.layer_token_lr_schedule: this block is not supported"
    ):
        _block(layer_token_lr_schedule={"enabled": True, "total_layer_tokens": 10})
    with pytest.raises(ConfigError, match=r"random_ltd_layer_id: 2 layer ids but random_ltd_layer_num is 1"):
        _block(random_ltd_layer_id=[0, 1])
    with pytest.raises(
        ConfigError, match=r"unknown key 'data_efficiency\.data_routing\.random_ltd\.drop_rate'"
    ):
        _block(drop_rate=0.5)


def test_deepspeed_paths_name_these_objects():
    import shardspeed

    routing = shardspeed.runtime.data_pipeline.data_routing
    assert routing.basic_layer.RandomLayerTokenDrop is RandomLayerTokenDrop
    assert routing.scheduler.RandomLTDScheduler is RandomLTDScheduler
    assert shardspeed.ops.random_ltd.dropping_utils.gather_tokens is gather_tokens
