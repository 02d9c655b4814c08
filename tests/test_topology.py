"""The process topology: rank <-> coordinates, validation, and a 1,024-rank dry run on torch's fake backend."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardspeed.comm.topology import (
    ParallelGrid,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)


def test_rank_coordinates_round_trip_last_axis_fastest():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=4)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.world_size() == 24
    for rank in range(24):
        assert topo.get_rank(**topo.get_coord(rank)) == rank
    coord = topo.get_coord(5)  # DeepSpeed's named tuple, also readable by axis name
    assert coord == topo.ProcessCoord(0, 1, 2) and (coord.pipe, coord.data, coord.model) == (0, 1, 2)
    assert coord["model"] == 2 and dict(**coord) == {"pipe": 0, "data": 1, "model": 2}
    assert topo.get_rank(pipe=1, data=0, model=0) == 12
    assert topo.get_axis_comm_lists("model")[0] == [0, 1, 2]
    assert topo.get_axis_comm_lists("pipe")[0] == [0, 12]
    assert topo.get_axis_list("pipe", 1) == list(range(12, 24))
    assert topo.filter_match(pipe=0, model=1) == [1, 4, 7, 10]
    assert topo.get_rank_repr(5) == "model_02"
    assert topo.get_dim("expert") == 0
    assert PipeDataParallelTopology(2, 2).get_coord(1)._asdict() == {"pipe": 0, "data": 1}


@pytest.mark.parametrize(
    ("axes", "dims", "message"),
    [
        (["pipe", "data"], [2], "2 axes"),
        (["pipe", "pipe"], [2, 2], "distinct"),
        (["pipe", "data"], [0, 4], "pipe=0"),
    ],
)
def test_bad_topologies_name_the_problem(axes, dims, message):
    with pytest.raises(ValueError, match=message):
        ProcessTopology(axes, dims)


def test_bad_coordinates_name_the_axis():
    topo = PipeDataParallelTopology(2, 2)
    with pytest.raises(ValueError, match="data=2"):
        topo.get_rank(pipe=0, data=2)
    with pytest.raises(ValueError, match="exactly the axes"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="rank 4"):
        topo.get_coord(4)


@pytest.fixture
def fake_world():
    """A fake process group of 1,024 ranks in this process: groups are created, nothing is communicated."""

    def start(rank: int, world: int = 1024):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_degrees_must_multiply_to_the_world(fake_world):
    fake_world(0, 1024)
    with pytest.raises(
        ValueError, match=r"pipe=8 x data=4 x model=4 = 128 ranks do not match the world size 1024"
    ):
        ParallelGrid(PipeModelDataParallelTopology(num_pp=8, num_mp=4, num_dp=4))


@pytest.mark.parametrize("rank", [0, 517, 1023])
def test_1024_rank_dry_run(fake_world, rank):
    """8 stages x 32 replicas x 4-way tensor parallel: each rank's groups, stage and neighbours."""
    fake_world(rank)
    topo = PipeModelDataParallelTopology(num_pp=8, num_mp=4, num_dp=32)
    grid = ParallelGrid(topo)
    coord = topo.get_coord(rank)
    assert grid.get_stage_id() == coord["pipe"] == rank // 128
    assert grid.get_data_parallel_rank() == coord["data"]
    assert grid.get_slice_parallel_rank() == coord["model"] == rank % 4
    assert grid.get_pipe_parallel_world_size() == 8
    assert grid.get_data_parallel_world_size() == 32
    assert grid.get_slice_parallel_world_size() == 4
    # Each group is exactly the ranks that differ from this one only along its axis.
    pipe_ranks = grid.axis_ranks("pipe")
    assert pipe_ranks == [rank % 128 + 128 * s for s in range(8)]
    assert grid.get_data_parallel_group_ranks() == [
        128 * coord["pipe"] + 4 * d + coord["model"] for d in range(32)
    ]
    assert grid.axis_ranks("model") == [rank - rank % 4 + m for m in range(4)]
    assert dist.get_world_size(grid.get_data_parallel_group()) == 32
    assert dist.get_world_size(grid.get_pipe_parallel_group()) == 8
    assert dist.get_world_size(grid.get_slice_parallel_group()) == 4
    # DeepSpeed's model-parallel group: one whole replica (8 stages x 4 tensor ranks).
    assert grid.get_model_parallel_world_size() == 32
    assert grid.is_first_stage() == (coord["pipe"] == 0)
    assert grid.is_last_stage() == (coord["pipe"] == 7)
    assert grid.stage_to_global(7) == pipe_ranks[-1]
    assert grid.stage_to_global(0, data=0) == topo.get_rank(pipe=0, data=0, model=coord["model"])
