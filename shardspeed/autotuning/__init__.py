"""The autotuner: `deepspeed --autotuning tune|run` finds the fastest config by short trainings (DeepSpeed's
`deepspeed.autotuning`).

Modules, in the order a search goes through them:

- `autotuner`    `Autotuner`: reads the user's config, walks the tuning spaces, writes the optimal config
- `space`        tuning spaces (ZeRO stage x offload) and each experiment's config and name
- `search_order` search orders over a list of experiments (`GridSearchTuner`, `RandomTuner`)
- `experiments`  `ResourceManager`: one experiment = one time-bounded run of the script via the launcher
- `summary`      `summary.txt`
- `dicts`        nested-dict helpers (DeepSpeed's `autotuning.utils`); `constants`: DeepSpeed's names

The measuring half lives in the engine (shardspeed/runtime/autotuning_probe.py): with the `autotuning`
block enabled it times the profiled steps, writes the metrics file and ends the run. Nothing here imports
torch; the launcher stays light.
"""

from .autotuner import Autotuner, AutotuningError

__all__ = ["Autotuner", "AutotuningError"]
