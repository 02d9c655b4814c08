"""DeepSpeed's 3D checkpoint descriptors (compat/mirrors/reshape_3d.py): the degrees of a checkpoint folder,
read from its files, and the rank maps of contracting a layout, checked against maps worked out by hand."""

from pathlib import Path

import pytest
import torch

from shardspeed.compat.mirrors.reshape_3d import ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc
from shardspeed.compat.not_offered import NotOfferedError

FIXTURES = Path(__file__).resolve().parent / "deepspeed_interop" / "fixtures"


def test_contracting_a_layout_maps_every_source_rank_once():
    # ranks of (pp 2, tp 2, dp 2): model-parallel rank i = pp * 2 + tp, data rank d adds 4 * d
    source = model_3d_desc(pp_degree=2, tp_degree=2, dp_degree=2)
    (one,) = source.reshape(model_3d_desc(1, 1, 1))
    assert one.get_data(0, 0) == [0, 4, 1, 5, 2, 6, 3, 7]
    (tp_kept,) = source.reshape(model_3d_desc(1, 2, 1))  # stages merged, tensor ranks kept apart
    assert (tp_kept.get_data(0, 0), tp_kept.get_data(0, 1)) == ([0, 4, 2, 6], [1, 5, 3, 7])
    first, second = source.reshape(model_3d_desc(1, 2, 2))  # data ranks kept too
    assert (first.get_data(0, 0), second.get_data(0, 1)) == ([0, 4], [3, 7])
    assert source.reshape(model_3d_desc(2, 2, 2))[1].get_data(1, 1) == [7]  # the identity
    ok, errors = source.can_reshape(model_3d_desc(4, 1, 1))
    assert not ok and errors == ["Expansion reshape not supported - PP: 2 ---> 4"]
    with pytest.raises(AssertionError, match="Expansion reshape not supported - TP: 2 ---> 3"):
        source.reshape(model_3d_desc(1, 3, 1))
    assert source.is_valid(1, 2, 0) == (False, ["TP indexing error: index 2 >= degree 2"])


def test_the_degrees_of_checkpoint_folders():
    # DeepSpeed's own folders (bf16 ZeRO-2 on 2 ranks; a 2-stage pipeline at ZeRO-1 on 2 ranks)
    s2 = get_model_3d_descriptor(FIXTURES / "s2-bf16" / "global_step3")
    assert (s2.pp_degree, s2.tp_degree, s2.dp_degree) == (1, 1, 2)
    pipe = ZeROCheckpoint(str(FIXTURES / "pipe-s1-fp32" / "global_step3"))
    assert (pipe.get_src_pp_degree(), pipe.get_src_tp_degree(), pipe.get_src_dp_degree()) == (2, 1, 1)
    pipe.reshape(model_3d_desc(1, 1, 1))  # one rank takes both stages' partitions
    assert [Path(f).name for f in pipe.get_files_for_rank(0, 0, 0)] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ]
    with pytest.raises(NotOfferedError, match="CheckpointReader"):
        pipe.get_state_for_rank(0, 0, 0)
    with pytest.raises(RuntimeError, match=r"no mp_rank_XX_model_states\.pt files"):
        get_model_3d_descriptor(FIXTURES / "s3-fp32" / "global_step3")


def test_recorded_degrees_must_be_in_every_model_states_file_and_agree(tmp_path):
    def write(dims: list) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for mp_rank, recorded in enumerate(dims):
            state = {} if recorded is None else {"checkpoint_parallel_dimensions": recorded}
            torch.save(state, folder / f"mp_rank_{mp_rank:02d}_model_states.pt")
            for dp_rank in range(3):
                torch.save({}, folder / f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
        return folder

    pp2 = {"pp_degree": 2, "tp_degree": 1}
    described = get_model_3d_descriptor(write([pp2, pp2]))
    assert (described.pp_degree, described.tp_degree, described.dp_degree) == (2, 1, 3)
    legacy = get_model_3d_descriptor(write([None, None]))  # no record: each model-states file a tensor rank
    assert (legacy.pp_degree, legacy.tp_degree, legacy.dp_degree) == (1, 2, 3)
    with pytest.raises(RuntimeError, match="missing from model-state files"):
        get_model_3d_descriptor(write([pp2, None]))
    with pytest.raises(RuntimeError, match="disagrees across model-state files"):
        get_model_3d_descriptor(write([pp2, {"pp_degree": 1, "tp_degree": 2}]))
    with pytest.raises(RuntimeError, match="pp_degree must be a positive integer"):
        get_model_3d_descriptor(write([{"pp_degree": 0, "tp_degree": 2}] * 2))
