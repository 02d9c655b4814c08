"""The interleaved (virtual-stage) 1F1B schedule: deadlock-free instruction lists, a smaller bubble than
1F1B in a timed simulation, and training equal to one process on 2 and 4 stages (with data parallelism,
ZeRO-1, clipping and a tied embedding), chosen by the PipelineModule argument or the `pipeline.virtual_stages`
config key; bad combinations refused with errors naming the numbers."""

import itertools

import pytest
from test_pipe_parity import case, check_case, pipeline_run

from shardspeed.pipe.schedule import (
    BackwardPass,
    ForwardPass,
    InferenceSchedule,
    InterleavedTrainSchedule,
    RecvActivation,
    SendActivation,
    TrainSchedule,
    simulate,
)

from harness import run_ranks


def test_interleaved_lists_are_complete_and_deadlock_free():
    for stages, chunks, micro in itertools.product([2, 3, 4], [1, 2, 3], [2, 3, 4, 6, 8, 12, 16]):
        if micro % stages:
            continue
        lists = [InterleavedTrainSchedule(micro, stages, s, chunks).steps() for s in range(stages)]
        simulate(lists)
        for steps in lists:
            forwards = [(i.micro_batch, i.chunk) for i in steps if isinstance(i, ForwardPass)]
            backwards = [(i.micro_batch, i.chunk) for i in steps if isinstance(i, BackwardPass)]
            units = sorted(itertools.product(range(micro), range(chunks)))
            assert sorted(forwards) == sorted(backwards) == units
        inference = [InferenceSchedule(micro, stages, s, chunks).steps() for s in range(stages)]
        simulate(inference)
    # one chunk is exactly the 1F1B schedule
    for stages, micro in itertools.product([1, 2, 4], [1, 3, 8]):
        for s in range(stages):
            assert (
                InterleavedTrainSchedule(micro, stages, s, 1).steps()
                == TrainSchedule(micro, stages, s).steps()
            )


def test_simulate_catches_a_deadlock_and_a_misordered_receive():
    stuck = [[RecvActivation(0, chunk=1), SendActivation(0)], [RecvActivation(0), SendActivation(0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(stuck)
    swapped = [[SendActivation(1), SendActivation(0)], [RecvActivation(0), RecvActivation(1)]]
    with pytest.raises(RuntimeError, match="would receive micro-batch 1"):
        simulate(swapped)


def test_interleaving_shrinks_the_bubble():
    """Unit-cost simulation (a stage's forward = 1, backward = 2, split evenly over its chunks): the idle share
    of the batch is exactly (p - 1) / (v m + p - 1), smaller for every v > 1."""
    for stages, micro in [(2, 4), (4, 8), (4, 16)]:
        bubbles = {}
        for chunks in (1, 2, 4):
            costs = {ForwardPass: 1 / chunks, BackwardPass: 2 / chunks}
            lists = [InterleavedTrainSchedule(micro, stages, s, chunks).steps() for s in range(stages)]
            makespan = simulate(lists, costs)
            bubbles[chunks] = 1 - 3 * micro / makespan
            ideal = (stages - 1) / (chunks * micro + stages - 1)
            assert bubbles[chunks] == pytest.approx(ideal, abs=1e-9), (stages, micro, chunks, bubbles)
        assert bubbles[4] < bubbles[2] < bubbles[1]


def test_schedule_errors_name_the_numbers():
    with pytest.raises(
        ValueError, match=r"gradient_accumulation_steps = 6\) to be a multiple of the stages \(4\)"
    ):
        InterleavedTrainSchedule(6, 4, 0, 2)


def test_interleaved_training_equals_one_process():
    """2 stages x 2 chunks on 2 ranks; 2 x 2 chunks x 2 replicas with ZeRO-1, and 4 stages x 2 chunks on 4
    ranks; one case turned on by the config key (the module is rebuilt), one with activation checkpointing."""
    two = [case(2, "Adam", clip=0.3, virtual=2), case(2, "SGD", virtual=2, by_config=True, interval=1)]
    results = run_ranks(pipeline_run, 2, two)
    for i, c in enumerate(two):
        check_case([r[i] for r in results], c)
    four = [case(2, "Adam", clip=0.3, zero=1, virtual=2), case(4, "Adam", clip=0.3, virtual=2, blocks=6)]
    results = run_ranks(pipeline_run, 4, four)
    for i, c in enumerate(four):
        check_case([r[i] for r in results], c)
