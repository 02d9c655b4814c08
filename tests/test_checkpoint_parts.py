"""The named-state protocol (checkpoint/parts.py): a part the checkpoint code has never heard of is saved and
loaded under its own name, its files travel with the tag, and a checkpoint without its state is refused
before anything loads, naming the part."""

import copy

import torch

from common import base_config
from harness import run_ranks
from models import TinyGPT


class _Dummy:
    """An extra part: one entry in the model-states file and one file per rank of its own."""

    name = "dummy"
    keys = ("dummy_state",)
    optional = False
    holds_weights = False

    def __init__(self, value: int):
        self.value = value
        self.from_file = None

    def state_dict(self, options):
        return {"dummy_state": {"value": torch.tensor([self.value])}}

    def write_files(self, staging, options):
        import torch.distributed as dist

        torch.save({"rank": dist.get_rank(), "value": self.value}, staging / f"dummy_{dist.get_rank()}.pt")

    def check(self, path, state, options):
        return None

    def load_state_dict(self, entries, ctx):
        import torch.distributed as dist

        self.value = int(entries["dummy_state"]["value"].item())
        self.from_file = torch.load(ctx.path / f"dummy_{dist.get_rank()}.pt", weights_only=True)


def _engine():
    import shardspeed

    torch.manual_seed(0)
    config = base_config(zero_optimization={"stage": 1})
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(config))
    return engine


def _round_trip(root: str) -> dict:
    import torch.distributed as dist

    from shardspeed.checkpoint import files
    from shardspeed.checkpoint.files import CheckpointError
    from shardspeed.checkpoint.parts import CheckpointPart, owned_keys

    engine = _engine()
    engine.checkpoint_parts().append(_Dummy(41 + dist.get_rank()))
    assert all(isinstance(p, CheckpointPart) for p in engine.checkpoint_parts())
    engine.save_checkpoint(f"{root}/with", tag="t", client_state={"epoch": 3})
    saved = torch.load(f"{root}/with/t/{files.model_states_name()}", weights_only=True)
    # every key in the file is owned by a part (or is the client's); a part may own a key it writes only when
    # it applies (the AutoTP layout, `universal_checkpoint_info`, only under tensor parallelism)
    owned = owned_keys(engine.checkpoint_parts())
    out = {"keys_ok": set(saved) <= owned | {"epoch"} and {"dummy_state", "epoch"} <= set(saved)}
    engine.checkpoint_parts().pop()
    engine.save_checkpoint(f"{root}/without", tag="t")  # saved by an engine without the part
    engine.destroy()

    engine = _engine()
    dummy = _Dummy(0)
    engine.checkpoint_parts().append(dummy)
    _, client_state = engine.load_checkpoint(f"{root}/with", tag="t")
    out.update(value=dummy.value, from_file=dummy.from_file, client_state=client_state)
    try:
        engine.load_checkpoint(f"{root}/without", tag="t")
        out["missing"] = None
    except CheckpointError as err:
        out["missing"] = str(err)
    out["value_after_refusal"] = dummy.value
    engine.destroy()
    return out


def test_unknown_part_round_trips_and_missing_state_names_it(tmp_path):
    results = run_ranks(_round_trip, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["keys_ok"]
        # the model-states file is written by data-parallel rank 0: every rank reads rank 0's entry
        assert out["value"] == 41
        assert out["from_file"] == {"rank": rank, "value": 41 + rank}  # each rank's own file
        assert out["client_state"] == {"epoch": 3}  # the part's entry is not the client's
        assert "'dummy'" in out["missing"] and "dummy_state" in out["missing"]
        assert out["value_after_refusal"] == 41  # refused before anything loaded
