"""Resume DeepSpeed 0.19.8's pipeline checkpoints saved at ZeRO stage 0 in shardspeed's PipelineEngine.

Two fixtures, written by DeepSpeed through tests/deepspeed_interop/make_fixtures.py (pipe_script.py at 2 ranks as
2 stages, 3 steps, a save; `expected.pt` is what DeepSpeed's uninterrupted run recorded for the 3 steps after):

- `pipe-s0-fp32`: each stage's `mp_rank_SS_model_states.pt` holds the torch optimizer's state without parameter
  names; shardspeed matches it to the layer files' parameters by order (deepspeed_format/pipeline.py), within
  1e-6 of DeepSpeed's run, at the saved layout and at 1 stage x 2 replicas (ZeRO 1);
- `pipe-s0-bf16`: DeepSpeed's BF16_Optimizer files (`bf16_zero_pp_rank_D_mp_rank_SS_optim_states.pt`), whose
  `param_slice_mappings` name the parameters; within bf16 rounding (4e-3: one bf16 step at magnitude 1) of
  DeepSpeed's run.

Damaged copies (the order rule broken, a state of the wrong shape, a missing BF16_Optimizer file, a slice mapping
the layout contradicts) are refused on every rank, naming the file, with the live weights untouched.
"""

import shutil
from pathlib import Path

import pytest
import torch

from harness import error_text, run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_interop" / "fixtures"
TOLERANCE = {"fp32": 1e-6, "bf16": 4e-3}
# (fixture dtype, stages, ZeRO stage) resumed from each fixture
LAYOUTS = [("fp32", 2, 0), ("fp32", 1, 1), ("bf16", 2, 0)]


def _rewrite(path: Path, change) -> None:
    from shardspeed.checkpoint.deepspeed_format import pickled

    content = pickled.load(path)
    change(content)
    torch.save(content, path)


def _set_params(counts):
    """The stages' optimizers hold `counts` parameters (indices 0..n-1 in one group)."""

    def change(content):
        content["optimizer"]["param_groups"][0]["params"] = list(range(counts))

    return change


def _swap_states(content):
    state = content["optimizer"]["state"]
    state[0], state[2] = state[2], state[0]


def _move_slice(content):
    mapping = content["optimizer_state_dict"]["param_slice_mappings"][0]
    mapping["2.weight"] = {"start": 40, "numel": mapping["2.weight"]["numel"]}


BAD = {  # fixture dtype, damage to a copy of its tag folder, what the refusal must say
    "counts differ": (
        "fp32",
        lambda d: _rewrite(d / "mp_rank_01_model_states.pt", _set_params(3)),
        ["mp_rank_00_model_states.pt", "[4, 3] parameters", "cannot be matched by order"],
    ),
    "stage cut inside a layer": (
        "fp32",
        lambda d: (
            _rewrite(d / "mp_rank_00_model_states.pt", _set_params(5)),
            _rewrite(d / "mp_rank_01_model_states.pt", _set_params(3)),
        ),
        ["mp_rank_00_model_states.pt", "inside layer 4", "cannot be matched to the stages by order"],
    ),
    "state of another shape": (
        "fp32",
        lambda d: _rewrite(d / "mp_rank_00_model_states.pt", _swap_states),
        ["mp_rank_00_model_states.pt", "of index 0 has shape (9, 7)", "'0.weight' (7, 5)"],
    ),
    "missing BF16_Optimizer file": (
        "bf16",
        lambda d: (d / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink(),
        ["bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt is missing"],
    ),
    "slice mapping against the layout": (
        "bf16",
        lambda d: _rewrite(d / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", _move_slice),
        ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "param_slice_mappings puts '2.weight'"],
    ),
}


def _in_ranks(tmp: str, bad: dict) -> dict:
    """In every rank: resume from each fixture at each layout of LAYOUTS and train on; then try each damaged
    copy in `bad` on an engine of its dtype."""
    import torch.distributed as dist
    from deepspeed_interop import pipe_script

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    out = {"resumed": {}, "refused": {}}
    for dtype, stages, zero in LAYOUTS:
        out["resumed"][(dtype, stages, zero)] = pipe_script.run(
            shardspeed, world, stages, zero, f"{tmp}/w-{dtype}-{stages}", load=str(FIXTURES / f"pipe-s0-{dtype}"),
            dtype=dtype,
        )  # fmt: skip
    engines = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        module = shardspeed.pipe.PipelineModule(
            layers=pipe_script.layers(shardspeed), num_stages=2, loss_fn=torch.nn.MSELoss(),
            partition_method="uniform",
        )  # fmt: skip
        engines[dtype], _, _, _ = shardspeed.initialize(
            model=module,
            model_parameters=list(module.parameters()),
            config=pipe_script.config(world, 2, 0, dtype),
        )
    for kind, folder in bad.items():
        engine = engines[BAD[kind][0]]
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        error = error_text(lambda engine=engine, folder=folder: engine.load_checkpoint(folder))
        unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
        out["refused"][kind] = (error, unchanged)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list:
    tmp = tmp_path_factory.mktemp("pipe0")
    bad = {}
    for kind, (dtype, damage, _) in BAD.items():
        folder = tmp / kind.replace(" ", "_")
        shutil.copytree(FIXTURES / f"pipe-s0-{dtype}", folder)
        damage(folder / "global_step3")
        bad[kind] = str(folder)
    return run_ranks(_in_ranks, 2, str(tmp), bad, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{d} {s} stages ZeRO {z}" for d, s, z in LAYOUTS])
def test_resumes_as_deepspeeds_uninterrupted_run(results, layout):
    dtype = layout[0]
    expected = torch.load(FIXTURES / f"pipe-s0-{dtype}" / "expected.pt")
    got = results[0]["resumed"][layout]
    assert sorted(got["weights"]) == sorted(expected["weights"])
    # the first step after the load runs on the loaded weights alone: equal in both precisions
    assert got["losses"][0] == pytest.approx(expected["losses"][0], abs=TOLERANCE["fp32"])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"]))
    weight_diff = max((got["weights"][n] - w).abs().max().item() for n, w in expected["weights"].items())
    assert loss_diff <= TOLERANCE[dtype] and weight_diff <= TOLERANCE[dtype], (loss_diff, weight_diff)
    assert got["counters"] == expected["counters"]


@pytest.mark.parametrize("kind", list(BAD))
def test_damaged_checkpoint_is_refused_on_every_rank(results, kind):
    for rank_result in results:
        error, unchanged = rank_result["refused"][kind]
        assert error.startswith("CheckpointError"), error
        for fragment in BAD[kind][2]:
            assert fragment in error, error
        assert unchanged, "a refused load changed the weights"
