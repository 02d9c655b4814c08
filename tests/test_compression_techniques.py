"""Each compression technique checked by its effect, on one process: distinct values per quantization group,
pruned fractions, reduced shapes, the cleaned (packed) model equal to the masked one, layer reduction."""

import math

import pytest
import torch
from compression_common import (
    Bert,
    ConvNet,
    batches,
    clone,
    every_technique,
    group,
    technique,
    weight_technique,
)
from torch import nn
from torch.nn import functional as F

from shardspeed.compression import distillation_loss, export_packed, load_packed_state
from shardspeed.compression.basic_layer import Conv2dLayer_Compress, LinearLayer_Compress
from shardspeed.compression.cleaning import CodeTensors
from shardspeed.compression.compress import init_compression, redundancy_clean, student_initialization
from shardspeed.compression.helper import convert_conv1d_to_linear, recursive_getattr, recursive_setattr
from shardspeed.compression.packed import PackedEmbedding, PackedLinear, PackedWeight
from shardspeed.compression.quantizers import fake_quantize, quantize_codes
from shardspeed.compression.scheduler import compression_scheduler
from shardspeed.compression.techniques import WeightQuantization
from shardspeed.compression.utils import (
    AsymQuantizer,
    BinaryQuantizer,
    SymQuantizer,
    TernaryQuantizer,
    TopKBinarizer,
)
from shardspeed.config import ConfigWarning
from shardspeed.inference.fusion import fuse_linears


def _cfg(compression: dict) -> dict:
    return {"compression_training": compression}


def _switch_on(model, config):
    scheduler = compression_scheduler(model, config)
    scheduler.step(step_zero_check=True)
    return scheduler


def _distinct_per_group(values: torch.Tensor, groups: int) -> list[int]:
    return [len(torch.unique(g)) for g in values.reshape(groups, -1)]


# ---- quantizers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("symmetric", [True, False])
def test_integer_quantization_has_at_most_two_to_the_bits_values_per_group(bits, symmetric):
    torch.manual_seed(0)
    weight = torch.randn(64, 48) * 3
    values = fake_quantize(weight, bits, groups=8, symmetric=symmetric)
    counts = _distinct_per_group(values, 8)
    assert max(counts) <= 2**bits and min(counts) > 2 ** (bits - 2)  # the grid is used, not collapsed
    # DeepSpeed's grids: symmetric steps of 2 max|x| / 2^b with the top code clamped (error <= 1 step);
    # asymmetric steps of (max - min) / 2^b, the offset rounded to a step and the top clamped (<= 1.5 steps)
    step = (weight.reshape(8, -1).amax(1) - weight.reshape(8, -1).amin(1)).max() / 2**bits
    assert (values - weight).abs().max() <= (1.5 * step if not symmetric else 2 * step)


def test_ternary_and_binary_values():
    torch.manual_seed(0)
    weight = torch.randn(16, 32)
    ternary = fake_quantize(weight, 2, groups=4)
    for g_values, g_weight in zip(ternary.reshape(4, -1), weight.reshape(4, -1)):
        alpha = g_values.abs().max()
        assert set(g_values.unique().tolist()) == {-alpha.item(), 0.0, alpha.item()}
        kept = g_weight.abs() > 0.7 * g_weight.abs().mean()  # XTC's threshold
        assert torch.equal(g_values != 0, kept)
        assert torch.allclose(alpha, g_weight.abs()[kept].mean())
    binary = fake_quantize(weight, 1, groups=4)
    for g_values, g_weight in zip(binary.reshape(4, -1), weight.reshape(4, -1)):
        assert torch.allclose(g_values, g_weight.sign() * g_weight.abs().mean())


def test_stochastic_rounding_is_unbiased_and_on_the_grid():
    torch.manual_seed(0)
    weight = torch.randn(1, 4096)
    nearest = fake_quantize(weight, 4, symmetric=True)
    runs = torch.stack([fake_quantize(weight, 4, symmetric=True, stochastic=True) for _ in range(200)])
    assert len(torch.unique(runs)) <= 16
    assert not torch.equal(runs[0], nearest)
    inside = weight.abs() < weight.abs().max() * 0.9  # away from the clamped end of the grid
    assert (runs.mean(0) - weight)[inside].abs().mean() < (nearest - weight)[inside].abs().mean() / 3


def test_deepspeed_autograd_quantizers_pass_gradients_straight_through():
    x = torch.randn(8, 16, requires_grad=True)
    for fn, args in ((SymQuantizer, (8, None, None, 2)), (AsymQuantizer, (4, None, None, 2)),
                     (TernaryQuantizer, (2, None, None, 2)), (BinaryQuantizer, (1, None, None, 2))):  # fmt: skip
        out = fn.apply(x, *args)
        out.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))
        x.grad = None
    static = SymQuantizer.apply(x, 8, torch.tensor(-1.0), torch.tensor(1.0), 1)
    assert len(torch.unique(static)) <= 256 and static.abs().max() <= 1.0
    mask = TopKBinarizer.apply(torch.arange(10.0), 0.3, False)
    assert mask.tolist() == [0] * 7 + [1] * 3


@pytest.mark.parametrize("groups", [1, 4])
def test_quantize_in_forward_uses_target_bits_from_the_first_enabled_step(groups):
    """DeepSpeed 0.18.9's quantize_weight_in_forward path quantizes at target_bits as soon as it is on, and
    redundancy_clean at target_bits too; start_bits and quantization_period drive only MoQ's schedule."""
    model = Bert()
    config = _cfg({"weight_quantization": weight_technique(
        {"schedule_offset": 2, "quantize_groups": groups},
        wq=group({"start_bits": 8, "target_bits": 4, "quantization_period": 2}, ["query"]),
    )})  # fmt: skip
    with pytest.warns(ConfigWarning, match=r"wq\.params\.start_bits: 8 .*MoQ.* at target_bits 4"):
        init_compression(model, config)
    scheduler = _switch_on(model, config)
    query = model.layer[0].attention.self.query
    bits, distinct = [], []
    for _ in range(10):
        scheduler.step()
        bits.append(query.weight_quantization.bits if query.weight_quantization_enabled else None)
        if query.weight_quantization_enabled:
            distinct.append(max(_distinct_per_group(query.compressed_weight()[0].detach(), groups)))
    assert bits == [None] + [4] * 9  # on at step 2, at 4 bits at once
    assert max(distinct) <= 2**4
    redundancy_clean(model, config)
    cleaned = model.layer[0].attention.self.query
    assert isinstance(cleaned, PackedLinear) and cleaned.packed.bits == 4
    assert max(_distinct_per_group(cleaned.packed.dequantize(torch.float32), groups)) <= 2**4


def test_moq_bit_schedule_steps_down_from_start_bits():
    """The schedule a layer enabled with quantize_weight_in_forward=False follows (MoQ's rule in 0.18.9's
    runtime/quantize.py): a bit fewer each time the period has passed, the period doubling."""
    schedule = WeightQuantization(start_bits=8, target_bits=5, period=2)
    bits = []
    for _ in range(10):
        schedule.advance()
        bits.append(schedule.bits)
    assert bits == [8, 7, 7, 6, 6, 6, 6, 5, 5, 5]
    layer = LinearLayer_Compress(8, 8)
    layer.enable_weight_quantization(8, 5, 2, False, "symmetric", 1)
    assert layer.weight_quantization.bits == 8
    layer.enable_weight_quantization(8, 5, 2, True, "symmetric", 1)
    assert layer.weight_quantization.bits == 5


def test_fp16_mixed_quantize_blends_towards_the_quantized_weight():
    model = Bert()
    config = _cfg({"weight_quantization": weight_technique(
        {"fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.25}},
        wq=group({"start_bits": 4, "target_bits": 4}, ["query"]),
    )})  # fmt: skip
    init_compression(model, config)
    scheduler = _switch_on(model, config)
    query = model.layer[0].attention.self.query
    full = query.weight.detach().clone()
    quantized = fake_quantize(full, 4)
    assert query.weight_quantization.mixed_ratio == 0.75  # the step-zero quantization step
    assert torch.allclose(query.compressed_weight()[0], 0.75 * full + 0.25 * quantized)
    for _ in range(3):
        scheduler.step()
    assert torch.equal(query.compressed_weight()[0], quantized)


# ---- activation quantization and pruning --------------------------------------------------------------


@pytest.mark.parametrize("calibration", ["dynamic", "static"])
def test_activation_quantization(calibration):
    model = Bert()
    config = _cfg({"activation_quantization": technique(
        {"schedule_offset": 0, "range_calibration": calibration}, aq=group({"bits": 4}, ["intermediate"])
    )})  # fmt: skip
    init_compression(model, config)
    _switch_on(model, config)
    dense = model.layer[0].intermediate.dense
    seen = []
    dense.register_forward_hook(lambda m, args, out: seen.append(m.quantize_input(args[0])))
    model(batches(1)[0])
    tokens = seen[0].reshape(-1, seen[0].shape[-1])
    if calibration == "dynamic":
        assert max(len(torch.unique(t)) for t in tokens) <= 16
    else:
        assert len(torch.unique(tokens)) <= 16  # one range for the whole tensor
        assert (
            float(dense.activation_quantizer.x_min_max[0])
            < 0
            < float(dense.activation_quantizer.x_min_max[1])
        )


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_sparse_pruning_keeps_the_dense_ratio(method):
    model = Bert()
    original = model.layer[0].attention.self.key.weight.detach().clone()
    config = _cfg({"sparse_pruning": technique(
        {"schedule_offset": 0, "method": method}, sp=group({"dense_ratio": 0.3}, ["key"])
    )})  # fmt: skip
    init_compression(model, config)
    _switch_on(model, config)
    weight = model.layer[0].attention.self.key.compressed_weight()[0]
    kept = weight != 0
    assert int(kept.sum()) == math.ceil(0.3 * weight.numel())
    if method == "l1":  # the largest magnitudes stay
        assert original.abs()[kept].min() >= original.abs()[~kept].max()
    else:  # learned scores: they get a gradient through the mask
        weight.sum().backward()
        assert model.layer[0].attention.self.key.sparse_mask_scores.grad.abs().sum() > 0


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_row_and_head_pruning_fractions(method):
    model = Bert()
    config = _cfg({
        "row_pruning": technique({"schedule_offset": 0, "method": method},
                                 rp=group({"dense_ratio": 0.25}, ["intermediate.dense"])),
        "head_pruning": technique({"schedule_offset": 0, "method": method, "num_heads": 4},
                                  hp=group({"dense_ratio": 0.5}, ["attention.output.dense"])),
    })  # fmt: skip
    init_compression(model, config)
    _switch_on(model, config)
    weight, bias = model.layer[0].intermediate.dense.compressed_weight()
    rows = weight.abs().sum(1) != 0
    assert int(rows.sum()) == 32 and torch.equal(bias != 0, rows)  # 25% of 128 rows, with their biases
    weight, _ = model.layer[0].attention.output.dense.compressed_weight()
    heads = weight.abs().sum(0).view(4, 8).sum(1) != 0
    assert int(heads.sum()) == 2


def test_channel_pruning_and_clean_of_a_conv_net():
    torch.manual_seed(0)
    model = ConvNet()
    config = _cfg({
        "channel_pruning": technique({"schedule_offset": 0, "method": "l1"},
                                     cp=group({"dense_ratio": 0.5}, ["conv1"], [["conv2", "bn1"]])),
        "weight_quantization": weight_technique({"quantize_groups": 8}, wq=group({"start_bits": 8, "target_bits": 8}, ["conv"])),
    })  # fmt: skip
    init_compression(model, config)
    assert isinstance(model.conv1, Conv2dLayer_Compress)
    _switch_on(model, config)
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        masked = model(x)
    assert int((model.conv1.compressed_weight()[0].abs().sum((1, 2, 3)) != 0).sum()) == 4
    redundancy_clean(model, config)
    assert (
        model.conv1.packed.shape[0] == 4 and model.conv2.packed.shape[1] == 4 and model.bn1.num_features == 4
    )
    with torch.no_grad():
        assert torch.allclose(model(x), masked, atol=1e-5)


# ---- cleaning ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse,row,head", [("l1", "l1", "l1"), ("topk", "topk", "topk")])
def test_clean_model_equals_the_masked_one_with_pruned_dimensions_removed(sparse, row, head):
    torch.manual_seed(0)
    model = Bert()
    config = _cfg(every_technique(sparse=sparse, row=row, head=head))
    init_compression(model, config)
    _switch_on(model, config)
    model.eval()
    tokens = batches(1)[0][:, :-1]
    with torch.no_grad():
        masked = model.logits(tokens)
    redundancy_clean(model, config)
    layer = model.layer[0]
    assert layer.intermediate.dense.packed.shape == (64, 32)  # half the rows
    assert layer.output.dense.packed.shape == (32, 64)  # and their columns downstream
    assert layer.attention.self.query.packed.shape == (16, 32)  # two of four heads, 8 rows each
    assert layer.attention.output.dense.packed.shape == (32, 16)
    assert layer.attention.self.num_attention_heads == 2 and layer.attention.self.all_head_size == 16
    assert all(
        not hasattr(m, "sparse_mask_scores") and not hasattr(m, "row_pruning_mask") for m in model.modules()
    )
    with torch.no_grad():
        assert torch.allclose(model.logits(tokens), masked, atol=1e-5)


@pytest.mark.parametrize("bits,qtype,groups", [(8, "symmetric", 1), (8, "asymmetric", 4), (4, "symmetric", 64),
                                               (3, "asymmetric", 8), (2, "symmetric", 4), (1, "symmetric", 2)])  # fmt: skip
def test_packed_layers_hold_codes_and_compute_exactly_what_the_quantized_layer_did(
    bits, qtype, groups, tmp_path
):
    torch.manual_seed(0)
    model = Bert(layers=1)
    config = _cfg({"weight_quantization": weight_technique(
        {"quantize_groups": groups, "quantization_type": qtype},
        wq=group({"start_bits": bits, "target_bits": bits}, ["dense", "query"]),
    )})  # fmt: skip
    init_compression(model, config)
    _switch_on(model, config)
    quantized = {
        n: m.compressed_weight()[0].detach()
        for n, m in model.named_modules()
        if isinstance(m, LinearLayer_Compress)
    }
    tokens = batches(1)[0][:, :-1]
    with torch.no_grad():
        before = model.logits(tokens)
    redundancy_clean(model, config)
    for name, value in quantized.items():
        layer = recursive_getattr(model, name)
        if isinstance(layer, PackedLinear):
            assert torch.equal(layer.packed.dequantize(torch.float32), value)
            stored = layer.packed.qweight.numel() * layer.packed.qweight.element_size()
            assert stored <= value.numel() * layer.packed.storage_bits / 8 + value.shape[0]
            assert layer.packed.storage_bits == {1: 1, 2: 2, 3: 4, 4: 4, 8: 8}[bits]
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4
    with torch.no_grad():  # the weights are exact; the products are summed in another order
        assert torch.allclose(model.logits(tokens), before, atol=1e-5)
    size = export_packed(model, tmp_path / "packed.safetensors")
    reloaded = Bert(layers=1)
    for name in ("layer.0.intermediate.dense",):
        assert isinstance(recursive_getattr(reloaded, name), nn.Linear)
    load_packed_state(reloaded, tmp_path / "packed.safetensors")
    with torch.no_grad():
        assert torch.equal(reloaded.logits(tokens), model.logits(tokens))
    assert size < sum(p.numel() * 4 for p in Bert(layers=1).parameters())


def test_embedding_quantization_is_token_wise_and_packs():
    torch.manual_seed(0)
    model = Bert(layers=1)
    config = _cfg({"weight_quantization": weight_technique(
        {"quantize_groups": 3}, wq=group({"start_bits": 4, "target_bits": 4}, ["embeddings"])
    )})  # fmt: skip
    init_compression(model, config)
    _switch_on(model, config)
    weight = model.embeddings.compressed_weight()[0]
    assert max(_distinct_per_group(weight, 64)) <= 16  # one group per token
    tokens = batches(1)[0][:, :-1]
    with torch.no_grad():
        before = model.logits(tokens)
    redundancy_clean(model, config)
    assert isinstance(model.embeddings, PackedEmbedding)
    with torch.no_grad():
        assert torch.equal(model.logits(tokens), before)


@pytest.mark.parametrize("bits,symmetric,groups", [(8, True, 1), (8, False, 4), (5, True, 7), (4, True, 14),
                                                    (4, False, 14), (3, False, 7), (2, True, 7), (1, True, 7)])  # fmt: skip
def test_packed_weight_roundtrip_and_matmul(bits, symmetric, groups):
    torch.manual_seed(0)
    codes = quantize_codes(torch.randn(7, 24), bits, groups, symmetric)
    tensors = CodeTensors(codes.codes, codes.per_element(codes.scale), codes.per_element(codes.offset), bits)
    packed = PackedWeight.from_codes(tensors)
    assert torch.equal(packed.codes().to(torch.int16), codes.codes)
    assert torch.equal(packed.dequantize(torch.float32), codes.values(torch.float32))
    assert packed.blocks == max(1, groups // 7) or groups % 7  # runs across rows: finer runs per row
    assert (
        packed.qweight.numel() == 7 * math.ceil(24 * packed.storage_bits / 8)
        or packed.qweight.dtype == torch.int8
    )
    x = torch.randn(3, 5, 24)  # codes times x, then scales and offsets: the same product up to rounding
    assert torch.allclose(packed.linear(x), F.linear(x, packed.dequantize(torch.float32)), atol=1e-5)
    assert torch.equal(packed.linear(x.half()), F.linear(x.half(), packed.dequantize(torch.float16)))


def test_packed_linears_fuse_into_one_call():
    torch.manual_seed(0)
    model = Bert(layers=1)
    config = _cfg({"weight_quantization": weight_technique(
        {"quantize_groups": 64}, wq=group({"start_bits": 4, "target_bits": 4}, ["attention.self"])
    )})  # fmt: skip
    init_compression(model, config)
    _switch_on(model, config)
    redundancy_clean(model, config)
    attention = model.layer[0].attention.self
    layers = [attention.query, attention.key, attention.value]
    x = torch.randn(2, 3, 32)
    separate = [layer(x) for layer in layers]
    fused = fuse_linears(layers)
    assert fused is not None
    for one, many in zip(fused(x), separate):
        assert torch.allclose(one, many, atol=1e-6)
    assert attention.query.packed.qweight.data_ptr() == fused.packed.qweight.data_ptr()  # views, no copy


# ---- layer reduction, distillation, helpers ---------------------------------------------------------------


def test_layer_reduction_copies_the_chosen_teacher_layers():
    torch.manual_seed(0)
    teacher, student = Bert(layers=4), Bert(layers=2)
    config = _cfg({"layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "layer",
                                       "teacher_layer": [1, 3], "other_module_name": ["embeddings", "classifier"]}})  # fmt: skip
    init_compression(student, config, teacher_model=teacher)
    for s, t in ((0, 1), (1, 3)):
        for (name, p), (_, q) in zip(
            student.layer[s].named_parameters(), teacher.layer[t].named_parameters()
        ):
            assert torch.equal(p, q), name
    assert torch.equal(student.embeddings.weight, teacher.embeddings.weight)
    with pytest.raises(ValueError, match="layer_reduction is enabled: pass teacher_model"):
        init_compression(Bert(layers=2), config)
    bad = _cfg({"layer_reduction": {"enabled": True, "module_name_prefix": "layer", "teacher_layer": [7]}})
    with pytest.raises(ValueError, match=r"teacher_layer: layer 7 does not exist"):
        student_initialization(Bert(layers=1), teacher, bad)


def test_distillation_loss():
    torch.manual_seed(0)
    student = torch.randn(3, 5, 11, requires_grad=True)
    teacher = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, 0] = -100
    t = 2.0
    loss = distillation_loss(student, teacher, labels, temperature=t, alpha=0.7)
    keep = labels.reshape(-1) != -100
    p_t = torch.softmax(teacher.reshape(-1, 11) / t, -1)[keep]
    log_p_s = torch.log_softmax(student.reshape(-1, 11) / t, -1)[keep]
    soft = (p_t * (p_t.log() - log_p_s)).sum(-1).mean() * t * t
    hard = nn.functional.cross_entropy(student.reshape(-1, 11), labels.reshape(-1))
    assert torch.allclose(loss, 0.7 * soft + 0.3 * hard, atol=1e-6)
    assert distillation_loss(teacher, teacher).abs() < 1e-6
    loss.backward()
    assert student.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="differ in shape"):
        distillation_loss(student, teacher[:, :2])


def test_helpers():
    model = Bert()
    assert recursive_getattr(model, "layer.1.attention.self.query") is model.layer[1].attention.self.query
    new = nn.Linear(32, 32)
    recursive_setattr(model, "layer.1.attention.self.query", new)
    assert model.layer[1].attention.self.query is new

    class Conv1D(nn.Module):  # Hugging Face's transposed linear
        def __init__(self, nf, nx):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.randn(nf))

        def forward(self, x):
            return x @ self.weight + self.bias

    convs = nn.ModuleList([Conv1D(6, 4), Conv1D(6, 4)])
    x = torch.randn(2, 4)
    expected = convs[0](x)
    convert_conv1d_to_linear(convs, Conv1D)
    assert isinstance(convs[0], nn.Linear) and torch.allclose(convs[0](x), expected)


def test_init_compression_keeps_parameter_objects_and_tied_weights():
    model = Bert()
    model.classifier.weight = model.embeddings.weight  # tied
    params = {id(p) for p in model.parameters()}
    init_compression(
        model,
        _cfg({"sparse_pruning": technique({"method": "l1"}, sp=group({"dense_ratio": 0.5}, ["query"]))}),
    )
    assert {id(p) for p in model.parameters()} == params
    assert model.classifier.weight is model.embeddings.weight
    assert all(isinstance(m, LinearLayer_Compress) for m in model.modules() if isinstance(m, nn.Linear))
    model_copy = clone(model)
    assert isinstance(model_copy.layer[0].attention.self.query, LinearLayer_Compress)
