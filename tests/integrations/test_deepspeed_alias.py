"""The `deepspeed` alias distribution (integrations/deepspeed-alias): every `deepspeed.X` is `shardspeed.X`.

Runs in a fresh interpreter with the alias staged on PYTHONPATH (as `pip install` would lay it out), so the
test needs nothing installed and leaves the test process's own imports alone.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from .alias_path import alias_version, env_with_alias

# Every module path and name Transformers 5.x, Accelerate 1.x and Lightning 2.x import on their DeepSpeed
# paths (docs/compatibility.md lists who uses which).
CHECK_NAMES = textwrap.dedent(
    """
    import importlib, importlib.metadata, importlib.util, sys
    import deepspeed, shardspeed
    assert deepspeed.__version__ == importlib.metadata.version("deepspeed") == VERSION, deepspeed.__version__
    modules = [
        "zero", "comm", "accelerator", "ops.adam", "ops.adagrad", "ops.lion", "ops.deepspeed4science", "utils", "utils.groups",
        "utils.logging", "checkpoint.utils", "runtime.engine", "runtime.lr_schedules", "runtime.zero",
        "runtime.zero.partition_parameters", "runtime.base_optimizer", "runtime.sequence_parallel.ulysses_sp",
        "launcher.runner",
    ]
    for name in modules:
        alias = importlib.import_module("deepspeed." + name)
        assert alias is importlib.import_module("shardspeed." + name), name
        # the module keeps its own name and spec (a DeepSpeed path the table maps may be a module of another name)
        assert alias.__name__ == alias.__spec__.name and alias.__name__.startswith("shardspeed."), alias.__spec__
    # no module exists twice: every deepspeed.* entry is the shardspeed.* module object
    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed."):
            assert module is sys.modules["shardspeed." + name[len("deepspeed."):]], name
    from deepspeed import DeepSpeedEngine, comm as dist, initialize, init_distributed, tp_model_init, zero
    from deepspeed.runtime.engine import DeepSpeedEngine as engine_class
    from deepspeed.runtime.zero.partition_parameters import zero_wrapper_for_fp_tensor_constructor, _orig_torch_arange
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.utils import logger, groups, set_z3_leaf_modules
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion
    from deepspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention  # OpenFold's import
    assert importlib.util.find_spec("deepspeed.ops.deepspeed4science") is not None  # OpenFold's check
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    assert DeepSpeedEngine is engine_class is shardspeed.ShardspeedEngine
    assert zero.Init is shardspeed.zero.Init and GatheredParameters is shardspeed.zero.GatheredParameters
    assert "WarmupDecayLR" in VALID_LR_SCHEDULES and DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert deepspeed.utils.logging.logger is logger  # attribute access after a bare `import deepspeed`
    # DeepSpeed paths that are not where shardspeed keeps them (shardspeed/compat/paths.py), by attribute
    assert deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer is not None
    assert deepspeed.runtime.pipe.module.PipelineModule is shardspeed.pipe.PipelineModule
    assert deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__name__
    assert deepspeed.utils.safe_get_local_grad is shardspeed.utils.safe_get_local_grad
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.git_version_info import torch_info
    from deepspeed.accelerator import is_current_accelerator_supported
    from deepspeed.utils.torch import required_torch_version
    from deepspeed import OnDevice
    assert CPUAdamBuilder().is_compatible() and required_torch_version(min_version=2.0)
    import deepspeed.runtime.pipe.topology as topology
    assert topology is shardspeed.comm.topology and sys.modules["deepspeed.runtime.pipe"] is shardspeed.pipe
    assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES is VALID_LR_SCHEDULES
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.current_device_name() == "cpu" and acc.device_name(0) == "cpu"
    import torch
    recorded = torch.nn.Linear(2, 2)
    assert tp_model_init(recorded, tp_size=2, dtype=torch.float32) is recorded  # records; initialize shards
    assert recorded._shardspeed_tp_model_init["tp_size"] == 2
    assert UlyssesSPDataLoaderAdapter is shardspeed.sequence.UlyssesSPDataLoaderAdapter  # ALST
    assert UlyssesSPAttentionHF is shardspeed.sequence.UlyssesSPAttentionHF
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
    assert parallel_state_sp is shardspeed.sequence.parallel_state
    try:
        import deepspeed.no_such_module
    except ModuleNotFoundError as error:
        assert error.name == "deepspeed.no_such_module", error.name
    else:
        raise AssertionError("expected ModuleNotFoundError")
    print("ALIAS OK")
    """
)


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**env, "SHARDSPEED_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_every_deepspeed_module_is_the_shardspeed_module(tmp_path):
    proc = _python(f"VERSION = {alias_version()!r}\n" + CHECK_NAMES, env_with_alias(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ALIAS OK" in proc.stdout


def test_python_dash_m_runs_a_deepspeed_module_path(tmp_path):
    """`python -m deepspeed.utils.zero_to_fp32` (as DeepSpeed's docs say) runs shardspeed's consolidation CLI."""
    env = {**env_with_alias(tmp_path / "site"), "SHARDSPEED_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", "--help"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "checkpoint_dir" in proc.stdout and "--max_shard_size" in proc.stdout


def test_real_deepspeed_also_on_the_path_is_refused(tmp_path):
    other = tmp_path / "elsewhere" / "deepspeed"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("__version__ = '0.19.8'\n")
    env = env_with_alias(tmp_path / "site")
    env["PYTHONPATH"] += f":{tmp_path / 'elsewhere'}"
    proc = _python("import deepspeed", env)
    assert proc.returncode != 0
    assert "two packages named 'deepspeed' are importable" in proc.stderr
    assert str(other / "__init__.py") in proc.stderr and "pip uninstall deepspeed" in proc.stderr
