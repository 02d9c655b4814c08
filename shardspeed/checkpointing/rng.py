"""Named RNG streams for model parallelism: `CudaRNGStatesTracker`, `get_cuda_rng_tracker`,
`model_parallel_cuda_manual_seed` (DeepSpeed's names; Megatron's design).

Tensor-parallel ranks must draw *different* dropout masks inside a sharded region and the *same* masks
elsewhere. The tracker keeps one generator state per name; `fork(name)` swaps that state into the
accelerator's default generator for the duration of a block and saves the advanced state afterwards.
Despite the name the tracker works on CPU too: there it forks the CPU generator.
"""

from __future__ import annotations

import contextlib

import torch

from shardspeed import accelerator

__all__ = [
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
]

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# DeepSpeed's offset between the data-parallel seed and the model-parallel region's seed.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _device_type() -> str:
    return "cuda" if accelerator.has_cuda() else "cpu"


def get_device_rng_state() -> torch.Tensor:
    """The default generator state of the accelerator (CUDA's current device, else the CPU's)."""
    return torch.cuda.get_rng_state() if _device_type() == "cuda" else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if _device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Generator states by name; `fork(name)` runs a block with that stream as the default generator."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (checkpointing saves these before a block runs)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`; names and seeds must be new (two streams with one seed
        would draw identical masks, the bug this class exists to prevent)."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already used by another tracked stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        saved = get_device_rng_state()
        torch.manual_seed(seed) if _device_type() == "cpu" else torch.cuda.manual_seed(seed)
        self.states_[name] = get_device_rng_state()
        set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(
                f"RNG stream {name!r} is not tracked; call model_parallel_cuda_manual_seed(seed) or "
                f"get_cuda_rng_tracker().add({name!r}, seed) first"
            )
        saved = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(saved)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tensor_parallel_rank: int | None = None) -> None:
    """Seed the default generator with `seed` (same on every tensor-parallel rank) and the model-parallel
    stream with `seed + 2718 + tp_rank` (different per rank), as DeepSpeed does. The rank comes from the
    configured mpu when not given."""
    if tensor_parallel_rank is None:
        from shardspeed.checkpointing import state

        tensor_parallel_rank = state.model_parallel_rank()
    model_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + tensor_parallel_rank
    _TRACKER.reset()
    if _device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)
