"""AutoTP placed by a Hugging Face tp_plan, and its layer rules as objects.

One process: `TPPlanConverter` (styles -> column / row / skip, gathered outputs, summed gradients, refusal
of a plan with an unknown style), `hf_tp_plan` (config, class and instance plans merged), `AutoTPConfig` /
`TPLayerSpec` (from a config dict; unknown keys and misplaced flags refused).
Two ranks through `initialize` at tp 2 (fp32): an encoder whose linear names AutoTP does not know trains by
its `base_model_tp_plan` equal to the one-process model (losses and weights within 1e-6), with its untied
head column-parallel with the output gathered and a norm marked `replicated_with_grad_allreduce` summing its
gradient; a tied head stays whole under a `colwise_gather_output` rule; `vocab_parallel_lm_head` splits the
head over the vocabulary whatever the plan says.
"""

import pytest
import torch
from torch import nn

from harness import run_ranks

PLAN = {
    "encoder.*.attention.query": "colwise",
    "encoder.*.attention.key": "colwise",
    "encoder.*.attention.output": "rowwise",
    "encoder.*.ffn.intermediate": "colwise",
    "encoder.*.ffn.output": "rowwise",
    "encoder.*.norm": "replicated_with_grad_allreduce",
}


class Encoder(nn.Module):
    """Blocks with names AutoTP's built-in rules do not place (`attention.output`, `ffn.intermediate`); the
    norm runs on this rank's half of the attention features, so its gradient is partial on each rank."""

    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, hidden=16, tied=False):
        super().__init__()
        self.config = type("Config", (), {"base_model_tp_plan": dict(PLAN)})()
        self.embed = nn.Embedding(32, hidden)
        self.encoder = nn.ModuleList(
            nn.ModuleDict({
                "attention": nn.ModuleDict({n: nn.Linear(hidden, hidden) for n in ("query", "key", "output")}),
                "norm": nn.LayerNorm(hidden, bias=False),
                "ffn": nn.ModuleDict({"intermediate": nn.Linear(hidden, 4 * hidden),
                                      "output": nn.Linear(4 * hidden, hidden)}),
            })
            for _ in range(2)
        )  # fmt: skip
        self.lm_head = nn.Linear(hidden, 32, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.encoder:
            att = block["attention"]
            mixed = att["query"](x) * torch.sigmoid(att["key"](x))  # elementwise: each rank's features only
            scale = block["norm"].weight
            if mixed.shape[-1] < scale.shape[0]:  # sharded: this rank's slice scales its features
                width = mixed.shape[-1]
                scale = scale.narrow(0, torch.distributed.get_rank() * width, width)
            x = x + att["output"](mixed * scale)
            x = x + block["ffn"]["output"](torch.relu(block["ffn"]["intermediate"](x)))
        logits = self.lm_head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


# -- one process ------------------------------------------------------------------------------------------------


def test_converter_maps_every_supported_style():
    from shardspeed.module_inject.autotp_config import PartitionType
    from shardspeed.module_inject.tp_plan import TPPlanConverter

    specs = TPPlanConverter.convert({**PLAN, "lm_head": "colwise_rep", "embed": "embedding_rowwise"})
    by_pattern = {s.patterns[0]: s for s in specs}
    q = by_pattern[r".*encoder\..*\.attention\.query\.weight$"]
    assert (q.partition_type, q.gather_output) == (PartitionType.COLUMN, False)
    assert by_pattern[r".*encoder\..*\.ffn\.output\.weight$"].partition_type is PartitionType.ROW
    norm = by_pattern[r".*encoder\..*\.norm\.weight$"]
    assert (norm.partition_type, norm.grad_allreduce) == (PartitionType.SKIP, True)
    head = by_pattern[r".*lm_head\.weight$"]
    assert (head.partition_type, head.gather_output) == (PartitionType.COLUMN, True)
    embed = by_pattern[r".*embed\.weight$"]
    assert (embed.partition_type, embed.grad_allreduce) == (PartitionType.SKIP, False)
    assert TPPlanConverter.convert({"a.weight": "rowwise"})[0].patterns == [r".*a\.weight$"]
    assert TPPlanConverter.convert({}) is None
    with pytest.raises(ValueError, match="local_colwise"):
        TPPlanConverter.convert({"q": "colwise", "o": "local_colwise"})


def test_hf_tp_plan_merges_config_class_and_instance_plans():
    from shardspeed.module_inject.tp_plan import hf_tp_plan

    model = Encoder()
    model._tp_plan = {
        "model.encoder.*.attention.query": "colwise",
        "extra": "rowwise",
    }  # prefixed repeat dropped
    assert hf_tp_plan(model) == {**PLAN, "lm_head": "colwise_gather_output", "extra": "rowwise"}
    assert hf_tp_plan(nn.Linear(2, 2)) is None
    model = Encoder()
    model.config.base_model_tp_plan = {}
    assert hf_tp_plan(model) == {"lm_head": "colwise_gather_output"}


def test_autotp_config_from_dict_and_refusals():
    from shardspeed.module_inject.autotp_config import AutoTPConfig, PartitionType, TPLayerSpec

    config = AutoTPConfig.from_dict({
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": [r".*\.lm_head\.weight$"], "partition_type": "column", "gather_output": True},
            {"patterns": [r".*\.qkv\.weight$"], "shape": [[8, 4, 4], -1], "model_types": ["Llama"]},
        ],
    })  # fmt: skip
    assert config.layer_specs[0].gather_output and not config.use_default_specs
    assert config.layer_specs[1].shape == ((8, 4, 4), -1)
    assert config.find_matching_spec("m.lm_head.weight") is config.layer_specs[0]
    assert (
        config.find_matching_spec("m.qkv.weight") is None
    )  # model type unknown: the typed rule does not apply
    assert config.find_matching_spec("m.qkv.weight", "llama") is config.layer_specs[1]
    assert TPLayerSpec([".*"], "row").get_partition_dim() == 1
    assert TPLayerSpec([".*"], "skip", grad_allreduce=True).as_dict()["grad_allreduce"] is True
    with pytest.raises(ValueError, match="gather_output applies to column"):
        TPLayerSpec([".*"], PartitionType.ROW, gather_output=True)
    with pytest.raises(ValueError, match="unsupported key"):
        AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["x"], "gather": True}]})


def test_config_block_refuses_misplaced_rule_flags():
    from shardspeed.config.tensor_parallel import parse_layer_specs

    rules = parse_layer_specs([{"patterns": ["a"], "partition_type": "row", "partition_dim": 1}])
    assert rules[0].kind == "row"
    with pytest.raises(ValueError, match="partition_dim"):
        parse_layer_specs([{"patterns": ["a"], "partition_type": "column", "partition_dim": 1}])
    with pytest.raises(ValueError, match="grad_allreduce"):
        parse_layer_specs([{"patterns": ["a"], "partition_type": "column", "grad_allreduce": True}])


# -- two ranks -----------------------------------------------------------------------------------------------------


def plan_job():
    import shardspeed
    from shardspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from shardspeed.module_inject.tp_state import tp_full_state_dict

    shardspeed.init_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.5,
              "steps_per_print": 1000}  # fmt: skip
    batches = torch.randint(0, 32, (3, 2, 6), generator=torch.Generator().manual_seed(5))

    torch.manual_seed(0)
    ref = Encoder()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for ids in batches:
        opt.zero_grad()
        loss = ref(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_losses.append(loss.item())

    torch.manual_seed(0)
    model = Encoder()
    engine, *_ = shardspeed.initialize(model=model, config=config)
    report = engine.tensor_parallel.report
    losses = []
    for ids in batches:
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = tp_full_state_dict(engine.module, engine.tensor_parallel.group)
    ref_state = ref.state_dict()

    torch.manual_seed(0)
    tied = Encoder(tied=True)
    shardspeed.initialize(model=tied, config={**config, "optimizer": None})
    vocab = (
        Encoder()
    )  # the plan gathers the head; vocab_parallel_lm_head splits it over the vocabulary instead
    vocab_config = {
        **config,
        "optimizer": None,
        "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True},
    }
    shardspeed.initialize(model=vocab, config=vocab_config)
    torch.manual_seed(1)  # DeepSpeed's form: a layer built from a whole module shards it for this rank
    whole = nn.Linear(4, 8)
    rank = torch.distributed.get_rank(engine.tensor_parallel.group)
    column = LinearLayer(whole, engine.tensor_parallel.group, name="c")
    whole_row = nn.Linear(8, 4)
    row = LinearAllreduce(whole_row, mp_group=engine.tensor_parallel.group)
    x = torch.randn(3, 4)

    # DeepSpeed's AutoTP object, rule-driven: q column, o row, f column fused as [a (2 rows); b (6 rows)]
    from shardspeed.module_inject.autotp_config import AutoTPConfig
    from shardspeed.module_inject.autotp_replacer import AutoTP

    names = {"q": (4, 8), "o": (8, 4), "keep": (4, 4), "f": (4, 8)}
    block = nn.ModuleDict({name: nn.Linear(*shape) for name, shape in names.items()})
    whole_block = {k: (v.weight.detach().clone(), v.bias.detach().clone()) for k, v in block.items()}
    rules = AutoTPConfig.from_dict(
        {
            "layer_specs": [
                {"patterns": [r".*q\.weight$"], "partition_type": "column"},
                {"patterns": [r".*f\.weight$"], "partition_type": "column", "shape": [[2, 6], -1]},
                {"patterns": [r".*o\.weight$"], "partition_type": "row"},
            ]
        }
    )
    autotp = AutoTP(block, (), "", None, None, None, partition_config=rules)
    autotp.set_tensor_parallel_config(2, engine.tensor_parallel.group)
    autotp._replace_module(block)

    def whole_linear(y, name):
        weight, bias = whole_block[name]
        return torch.nn.functional.linear(y, weight, bias)

    sharded = block["keep"](block["o"](block["q"](x)))
    reference = whole_linear(whole_linear(whole_linear(x, "q"), "o"), "keep")
    fused = whole_block["f"][0]
    return dict(
        autotp=(
            type(block["q"]).__name__,
            type(block["o"]).__name__,
            type(block["keep"]).__name__,
            tuple(block["q"].weight.shape),
            (sharded - reference).abs().max().item(),
            # this rank holds its row of a and its 3 rows of b
            torch.equal(
                block["f"].weight, torch.cat([fused[rank : rank + 1], fused[2 + 3 * rank : 5 + 3 * rank]])
            ),
        ),
        deepspeed_form=(
            torch.equal(column.weight, whole.weight[rank * 4 : (rank + 1) * 4]),
            (column.tp_index, column.tp_world_size, column.name, tuple(row.weight.shape)),
            (row(column(x)) - whole_row(whole(x))).abs().max().item(),  # column -> row equals the whole pair
        ),
        rank=rank,
        loss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        weight=max((full[k] - ref_state[k]).abs().max().item() for k in ref_state),
        head=(
            type(model.lm_head) is LinearLayer,
            model.lm_head.gather_output,
            tuple(model.lm_head.weight.shape),
        ),
        report=(sorted(report.column), sorted(report.row), report.gathered, sorted(report.grad_summed)),
        tied=(type(tied.lm_head) is nn.Linear, tied.lm_head.weight is tied.embed.weight),
        vocab=(type(vocab.lm_head).__name__, type(vocab.embed).__name__, tuple(vocab.lm_head.weight.shape)),
    )


def test_tp_plan_places_and_trains_equal_to_one_process():
    results = run_ranks(plan_job, 2)
    for out in results:
        assert out["loss"] < 1e-6 and out["weight"] < 1e-6, out
        assert out["head"] == (True, True, (16, 16))
        column, row, gathered, summed = out["report"]
        assert column == ["encoder.0.attention.key", "encoder.0.attention.query", "encoder.0.ffn.intermediate",
                          "encoder.1.attention.key", "encoder.1.attention.query", "encoder.1.ffn.intermediate",
                          "lm_head"]  # fmt: skip
        assert row == ["encoder.0.attention.output", "encoder.0.ffn.output", "encoder.1.attention.output",
                       "encoder.1.ffn.output"]  # fmt: skip
        assert gathered == ["lm_head"]
        assert summed == ["encoder.0.norm.weight", "encoder.1.norm.weight"]
        assert out["tied"] == (True, True)
        same, attrs, pair = out["deepspeed_form"]
        assert same and attrs[:3] == (out["rank"], 2, "c") and attrs[3] == (4, 4) and pair < 1e-6
        assert out["autotp"][:4] == ("LinearLayer", "LinearAllreduce", "Linear", (4, 4)), out["autotp"]
        assert out["autotp"][4] < 1e-6 and out["autotp"][5], out["autotp"]
        assert out["vocab"] == ("VocabParallelLMHead", "VocabParallelEmbedding", (16, 16))


def test_universal_checkpoint_info_and_deepspeed_layer_form_on_one_rank():
    from shardspeed.compat.mirrors.runtime_utils import is_model_parallel_parameter
    from shardspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from shardspeed.module_inject.tp_state import universal_checkpoint_info

    model = nn.Module()
    model.proj = LinearAllreduce(nn.Linear(16, 8), mp_group=None, name="proj")
    model.lm_head = LinearLayer(nn.Linear(16, 40), None, gather_output=True)
    model.norm = nn.LayerNorm(16)
    model.alias = nn.Linear(16, 40)
    model.alias.weight = model.lm_head.weight  # a tied alias: described under its first name only
    info = universal_checkpoint_info(model)
    assert info["parameter_with_row_parallelism_patterns"] == [r"^proj\.weight$"]
    assert info["tp_replicated_parameter_patterns"] == [r"^alias\.bias$", r"^norm\.bias$", r"^norm\.weight$",
                                                         r"^proj\.bias$"]  # fmt: skip
    assert (
        info["vocabulary_parameter_patterns"] == [r"^lm_head\.weight$"] and info["original_vocab_size"] == 40
    )
    assert info["autotp_unsupported_parameter_patterns"] == {} and model.lm_head.gather_output
    assert is_model_parallel_parameter(model.proj.weight) and not is_model_parallel_parameter(model.proj.bias)
    from shardspeed.module_inject.layers import SubParamLinearLayer

    packed = nn.Module()
    packed.qkv = SubParamLinearLayer(nn.Linear(4, 12), None, shape=((6, 3, 3), -1), partition_dim=0)
    packed_info = universal_checkpoint_info(packed)
    entries = packed_info["parameter_with_sub_params"]
    # the shape spec as given, the parts' sizes at the split dimension, and each rank's width of each part
    assert [(e["patterns"], e["shape"], e["partition_dim"]) for e in entries] == [
        ([r"^qkv\.weight$"], [(6, 3, 3), -1], 0),
        ([r"^qkv\.bias$"], [(6, 3, 3)], 0),
    ]
    assert packed_info["sub_param_shard_widths"][r"^qkv\.weight$"] == [[6], [3], [3]]
    with pytest.raises(ValueError, match="do not add up"):
        SubParamLinearLayer(nn.Linear(4, 12), None, shape=((6, 3), -1))
    with pytest.raises(TypeError, match="gather_output"):
        LinearAllreduce(nn.Linear(2, 2), None, gather_output=True)  # row layers have no gathered output
    with pytest.raises(ValueError, match="skip_partition"):
        LinearLayer(nn.Linear(2, 2), None, skip_partition=True)


def test_autotp_object_refuses_what_it_does_not_do():
    from shardspeed.module_inject.autotp_replacer import AutoTP

    with pytest.raises(NotImplementedError, match="partition_config=None"):
        AutoTP(nn.Linear(2, 2), (), "", None, None, None)
    with pytest.raises(NotImplementedError, match="tp_grain_size"):
        AutoTP(
            nn.Linear(2, 2), (), "", None, None, None, partition_config={"layer_specs": []}, tp_grain_size=64
        )
