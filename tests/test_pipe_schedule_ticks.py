"""DeepSpeed's step-by-step view of the pipeline schedules (`iter(schedule)`, `ticks()`): the same order of
forwards and backwards per stage as the instruction list the engine runs (`steps()`), every transfer
received on the step its peer sends it, and buffer ids within `num_pipe_buffers()`."""

from __future__ import annotations

import pytest

from shardspeed.pipe.schedule import (
    BackwardPass,
    ForwardPass,
    InferenceSchedule,
    InterleavedTrainSchedule,
    MicroBatchInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

_PEER = {SendActivation: (RecvActivation, +1), SendGrad: (RecvGrad, -1)}


def _compute_order(instructions):
    return [(type(i), i.micro_batch) for i in instructions if isinstance(i, ForwardPass | BackwardPass)]


@pytest.mark.parametrize("kind", [TrainSchedule, InferenceSchedule])
@pytest.mark.parametrize(("micro_batches", "stages"), [(1, 1), (4, 1), (1, 3), (3, 3), (8, 3), (5, 4)])
def test_ticks_keep_the_engine_order_and_match_every_transfer_on_its_step(kind, micro_batches, stages):
    schedules = [kind(micro_batches, stages, s) for s in range(stages)]
    ticks = [list(iter(schedule)) for schedule in schedules]
    steps = {len(t) for t in ticks}
    expected = 2 * (micro_batches + stages - 1) if kind is TrainSchedule else micro_batches + stages - 1
    assert steps == {expected}  # every stage takes the same number of steps
    for schedule, stage_ticks in zip(schedules, ticks, strict=True):
        flat = [inst for step in stage_ticks for inst in step]
        assert _compute_order(flat) == _compute_order(schedule.steps())
        for inst in flat:
            if isinstance(inst, MicroBatchInstruction):
                assert inst.buffer_id == inst.micro_batch % schedule.num_pipe_buffers()
    every = [type(inst) for stage_ticks in ticks for step in stage_ticks for inst in step]
    assert every.count(SendActivation) == every.count(RecvActivation)
    assert every.count(SendGrad) == every.count(RecvGrad)
    for stage, stage_ticks in enumerate(ticks):
        for step, cmds in enumerate(stage_ticks):
            for inst in cmds:
                if type(inst) in _PEER:
                    receive, direction = _PEER[type(inst)]
                    peer_step = ticks[stage + direction][step]
                    received = [
                        (type(i), i.micro_batch) for i in peer_step if isinstance(i, MicroBatchInstruction)
                    ]
                    assert (receive, inst.micro_batch) in received, (stage, step, inst)


def test_deepspeed_names_of_the_schedule_shape():
    schedule = TrainSchedule(micro_batches=4, stages=3, stage_id=1)
    assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == (1, 3, 4)
    assert (schedule.prev_stage, schedule.next_stage) == (0, 2)
    assert schedule.num_pipe_buffers() == 2 and TrainSchedule(4, 3, 0).num_pipe_buffers() == 3
    assert InferenceSchedule(4, 3, 0).num_pipe_buffers() == 2


def test_interleaved_orders_have_no_lockstep_view():
    with pytest.raises(NotImplementedError, match="no lockstep view"):
        list(iter(InterleavedTrainSchedule(4, 2, 0, 2)))
    with pytest.raises(NotImplementedError, match="no lockstep view"):
        list(iter(InferenceSchedule(4, 2, 0, chunks=2)))
