"""DeepSpeed's import paths on shardspeed (shardspeed/compat/paths.py): every table entry resolves to what it
names or to a stand-in that raises NotOfferedError naming itself; every public name of DeepSpeed 0.19.8 in
tests/deepspeed_0_19_8_names.txt resolves; `deepspeed.X.Y` works after a bare import; the small DeepSpeed
modules the table points at behave as DeepSpeed's (op builders, git_version_info, utils.torch, OnDevice,
DeepSpeedConfig, partitioning helpers).
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import shardspeed
from shardspeed.compat.finder import resolve
from shardspeed.compat.not_offered import NotOffered, NotOfferedError
from shardspeed.compat.paths import PATHS

NAMES_FILE = Path(__file__).with_name("deepspeed_0_19_8_names.txt")


def _walk(path: str):
    """`shardspeed.<path>` by attribute access only, as `deepspeed.<path>` after a bare import."""
    obj = shardspeed
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _assert_stand_in(obj, path: str) -> None:
    """A stand-in: calling it raises NotOfferedError naming the DeepSpeed path."""
    if isinstance(obj, types.ModuleType):
        obj = obj.SomeName
        path = f"{path}.SomeName"
    with pytest.raises(NotOfferedError, match=f"deepspeed.{path} is not offered by shardspeed: "):
        obj()
    with pytest.raises(NotOfferedError):
        obj(1, key=2)


# Packages some table targets import (DeepSpeed's pydantic config classes, compat/mirrors/config_model.py)
# that a core install lacks: there such an entry must fail naming the package, and in no other way.
OPTIONAL_PACKAGES = ("pydantic",)


def _missing_optional_package(path: str) -> bool:
    """True when `path` cannot resolve only because an optional package is not installed."""
    try:
        _walk(path)
    except ModuleNotFoundError as error:
        assert error.name in OPTIONAL_PACKAGES, f"{path}: {error}"
        return True
    return False


def test_every_table_entry_resolves_to_its_target_or_a_named_stand_in():
    for path, target in PATHS.items():
        if not path.endswith(".*") and _missing_optional_package(path):
            continue
        if path.endswith(".*"):
            module = importlib.import_module(target)
            name = module.__all__[0]
            assert _walk(f"{path[:-2]}.{name}") is getattr(module, name), path
            continue
        obj = _walk(path)
        if isinstance(target, NotOffered):
            assert isinstance(obj, types.ModuleType) == target.module, path
            _assert_stand_in(obj, path)
        elif ":" in target:
            module_name, attribute = target.split(":")
            assert obj is getattr(importlib.import_module(module_name), attribute), path
        else:
            assert obj is importlib.import_module(target), path
        assert resolve(path) is obj, path


def test_table_entries_name_where_a_class_or_function_is_defined():
    """One hop: an entry names the module that defines the object, not one that re-exports it."""
    hops = []
    for path, target in PATHS.items():
        if isinstance(target, str) and ":" in target and target.startswith("shardspeed."):
            if _missing_optional_package(path):
                continue
            module_name, attribute = target.split(":")
            obj = getattr(importlib.import_module(module_name), attribute)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                hops += (
                    [f"{path}: {target} is defined in {obj.__module__}"]
                    if obj.__module__ != module_name
                    else []
                )
    assert hops == []


def test_library_modules_never_import_the_mirrors():
    """compat/mirrors exists only for DeepSpeed's paths: the library reaches none of it except through the table."""
    root = Path(shardspeed.__file__).parent
    importers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "compat" not in path.relative_to(root).parts
        and "compat.mirrors" in path.read_text(encoding="utf-8")
    ]
    assert importers == []


def test_every_public_name_of_deepspeed_0_19_8_resolves():
    names = [
        line.strip() for line in NAMES_FILE.read_text().splitlines() if line.strip()[:1] not in ("", "#")
    ]
    assert len(names) > 400
    missing = []
    for path in names:
        try:
            _missing_optional_package(path)
        except AttributeError as error:
            missing.append(f"{path}: {error}")
    assert not missing, missing


def test_module_paths_import_as_the_same_module_objects():
    pipe_module = importlib.import_module("shardspeed.runtime.pipe.module")
    assert pipe_module is importlib.import_module("shardspeed.pipe.module")
    assert sys.modules["shardspeed.runtime.pipe"] is shardspeed.pipe
    assert importlib.import_module("shardspeed.runtime.pipe.topology") is importlib.import_module(
        "shardspeed.comm.topology"
    )
    assert importlib.import_module("shardspeed.utils.zero_to_fp32") is importlib.import_module(
        "shardspeed.checkpoint.consolidate"
    )
    stage3 = importlib.import_module("shardspeed.runtime.zero.stage3")  # a path with no file of its own
    assert stage3.DeepSpeedZeroOptimizer_Stage3 is resolve(
        "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
    )
    assert "DeepSpeedZeroOptimizer_Stage3" in dir(stage3)
    tuner = importlib.import_module("shardspeed.autotuning.tuner.base_tuner")  # a DeepSpeed module name
    assert tuner is importlib.import_module("shardspeed.autotuning.search_order")
    model_based = importlib.import_module("shardspeed.autotuning.tuner.model_based_tuner")  # not offered
    _assert_stand_in(model_based.ModelBasedTuner, "autotuning.tuner.model_based_tuner.ModelBasedTuner")


def test_unknown_names_and_modules_are_still_errors():
    with pytest.raises(
        AttributeError, match=r"module 'shardspeed\.utils' has no attribute 'safe_get_ful_grad'"
    ):
        shardspeed.utils.safe_get_ful_grad  # noqa: B018 (a misspelt name is not made into a stand-in)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shardspeed.runtime.no_such_module")
    with pytest.raises(AttributeError):
        shardspeed.runtime.zero.stage3.NoSuchClass  # noqa: B018


def test_table_module_aliases_do_not_shadow_real_files():
    root = Path(shardspeed.__file__).parent
    for path, target in PATHS.items():
        if isinstance(target, str) and ":" not in target and not path.endswith(".*"):
            relative = root.joinpath(*path.split("."))
            assert not relative.with_suffix(".py").exists() and not relative.is_dir(), path


def test_attribute_access_after_a_bare_import_in_a_fresh_interpreter():
    code = (
        "import shardspeed as deepspeed\n"
        "f = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer\n"
        "assert callable(f)\n"
        "assert deepspeed.utils.groups.get_data_parallel_world_size is not None\n"
        "assert deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__name__\n"
        "assert deepspeed.runtime.pipe.PipelineModule is deepspeed.pipe.PipelineModule\n"
        "assert deepspeed.runtime.lr_schedules.WARMUP_LR == 'WarmupLR'\n"
        "assert deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint\n"
        "assert deepspeed.ops.__compatible_ops__['cpu_adam'] is True\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_stand_ins_are_never_instances():
    stand_in = shardspeed.DualPipeVEngine
    assert not isinstance(object(), stand_in)
    assert stand_in.__name__ == "DualPipeVEngine"
    with pytest.raises(NotOfferedError, match="DualPipeV pipeline schedule"):
        stand_in(model=None)


def test_op_builders_say_nothing_needs_building():
    from shardspeed.ops import op_builder

    adam = op_builder.CPUAdamBuilder()
    assert adam.NAME == "cpu_adam" and adam.is_compatible() and adam.sources() == []
    with pytest.raises(NotOfferedError, match="'adam_update' does not exist in shardspeed"):
        adam.load().adam_update  # noqa: B018
    transformer = op_builder.TransformerBuilder()
    assert not transformer.is_compatible()
    with pytest.raises(NotOfferedError, match=r"the transformer op \(TransformerBuilder\) is not offered"):
        transformer.load()
    assert shardspeed.ops.__compatible_ops__ == shardspeed.git_version_info.installed_ops
    assert shardspeed.git_version_info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert shardspeed.git_version_info.version == shardspeed.__version__


def test_required_torch_version_compares_as_deepspeed():
    from shardspeed.utils.torch import required_torch_version

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=f"{major}.{minor}")
    assert required_torch_version(min_version=1.8, max_version=f"{major + 1}.0")
    assert not required_torch_version(min_version=f"{major + 1}.0")
    assert not required_torch_version(max_version=f"{major}.{minor - 1}")
    with pytest.raises(ValueError, match="give min_version, max_version or both"):
        required_torch_version()


def test_on_device_builds_modules_on_the_device_in_the_dtype():
    with shardspeed.OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 3)
        table = torch.nn.Embedding(5, 2)
    assert all(
        p.device.type == "meta" and p.dtype == torch.float16
        for p in [*layer.parameters(), *table.parameters()]
    )
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"  # restored
    with shardspeed.OnDevice(dtype=torch.float16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    with pytest.raises(
        ValueError, match=r"OnDevice\(dtype=\.\.\.\): expected a floating-point torch\.dtype, got torch\.int8"
    ):
        shardspeed.OnDevice(dtype=torch.int8)


def test_deepspeed_config_reads_deepspeed_names(monkeypatch):
    config = shardspeed.DeepSpeedConfig(
        {"train_batch_size": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
         "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
         "tensorboard": {"enabled": True, "job_name": "run"}}
    )  # fmt: skip
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (8, 4)
    assert config.zero_optimization_stage == 2 and config.zero_enabled and config.bfloat16_enabled
    assert config.zero_config.stage == shardspeed.runtime.zero.config.ZeroStageEnum.gradients
    assert config.optimizer_name == "adamw" and config.optimizer_params == {"lr": 0.1}
    assert config.monitor_config.tensorboard.job_name == "run" and config.monitor_config.enabled
    assert not shardspeed.monitor.config.DeepSpeedMonitorConfig().enabled
    with pytest.raises(shardspeed.DeepSpeedConfigError, match=r"zero_optimization\.stage"):
        shardspeed.DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 7}})


def test_cpu_device_count_is_the_local_world_size(monkeypatch):
    from shardspeed.accelerator.facade import DeviceAccelerator

    cpu = DeviceAccelerator("cpu")
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun
    assert cpu.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher and ours
    assert cpu.device_count() == 2
    assert shardspeed.accelerator.is_current_accelerator_supported()
    with pytest.raises(
        TypeError, match=r"set_accelerator: expected an accelerator from shardspeed\.accelerator"
    ):
        shardspeed.accelerator.set_accelerator(object())


def test_deepspeeds_cuda_and_cpu_accelerator_classes(monkeypatch):
    """`accelerator.cpu_accelerator.CPU_Accelerator` / `cuda_accelerator.CUDA_Accelerator` are the objects
    `get_accelerator()` returns, and `set_accelerator` with one makes it the current accelerator."""
    from shardspeed.accelerator import facade
    from shardspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from shardspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(facade, "_chosen", [])
    automatic = shardspeed.accelerator.get_accelerator()
    assert type(automatic) is CPU_Accelerator and automatic is shardspeed.accelerator.get_accelerator()
    cuda = CUDA_Accelerator()  # built without a GPU, as DeepSpeed's is; only its device calls need one
    assert (cuda.device_name(), cuda.communication_backend_name()) == ("cuda", "nccl")
    cpu = CPU_Accelerator()
    assert (cpu.device_name(), cpu.communication_backend_name(), cpu.device(0)) == (
        "cpu",
        "gloo",
        torch.device("cpu"),
    )
    shardspeed.accelerator.set_accelerator(cuda)
    assert shardspeed.accelerator.get_accelerator() is cuda
    # DeepSpeed's other accelerator modules (NPU, HPU, XPU, ...) are real modules whose classes refuse to be
    # built (tests/test_accelerator_classes.py), not table entries
    from shardspeed.compat.paths import PATHS

    assert "accelerator.npu_accelerator" not in PATHS and "accelerator.cpu_accelerator" not in PATHS


def test_partition_helpers_give_deepspeeds_bounds():
    from shardspeed.runtime.utils import (
        partition_balanced,
        partition_uniform,
        prefix_sum_inc,
        prime_factors,
    )

    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # fewer items than parts: the rest empty
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    # the least varying split, not only the lightest heaviest part ([2, 2, 0, 1] has the same heaviest part)
    assert partition_balanced([1, 1, 1, 1, 0, 1], 4) == [0, 1, 2, 3, 6]
    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert prime_factors(12) == [2, 2, 3] and prime_factors(7) == [7]


def test_expert_parallel_ranks_cut_data_slices():
    from shardspeed.moe.groups import expert_parallel_ranks

    ep, edp = expert_parallel_ranks(world_size=16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    with pytest.raises(ValueError, match="expert_parallel_size_ 3 must divide the data-parallel size 8"):
        expert_parallel_ranks(16, 2, 3)


def test_z3_leaf_modules_by_name_and_suffix():
    from shardspeed.utils.z3_leaf_module import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    marked, missing = set_z3_leaf_modules_by_name(model, ["1.0", "9"], raise_if_not_found=False)
    assert marked == [model[1][0]] and missing == ["9"] and model[1][0]._z3_leaf
    with pytest.raises(ValueError, match=r"no module named \['9'\]"):
        set_z3_leaf_modules_by_name(model, ["9"])
    marked, missing = set_z3_leaf_modules_by_suffix(model, ["0"], flag=False)
    assert set(map(id, marked)) == {id(model[0]), id(model[1][0])} and not model[1][0]._z3_leaf


def test_launcher_helpers_under_deepspeeds_names():
    from shardspeed.launcher import runner

    hosts = {"w0": [0, 1, 2, 3], "w1": [0, 1]}
    assert runner.parse_resource_filter(hosts) == hosts
    assert runner.parse_resource_filter(hosts, exclude_str="w0:1@w1") == {"w0": [0, 2, 3]}
    assert (
        runner.parse_resource_filter(hosts, exclude_str="w0@w1") == {}
    )  # the launcher refuses this, not here
    with pytest.raises(ValueError, match="host 'jeff' is not in the hostfile"):
        runner.parse_resource_filter(hosts, include_str="jeff")
    with pytest.raises(ValueError, match="cannot be used together"):
        runner.parse_resource_filter(hosts, include_str="w0", exclude_str="w1")
    assert runner._parse_hostfile(["  w1 slots=2", "# a comment", ""]) == {"w1": 2}
    with pytest.raises(ValueError, match="listed twice"):
        runner._parse_hostfile(["a slots=1", "a slots=2"])
    assert runner.parse_args(["--num_gpus", "2", "train.py", "--lr", "1"]).user_args == ["--lr", "1"]


def test_precision_config_getters_read_the_blocks():
    from shardspeed.config import ConfigError

    precision = shardspeed.runtime.precision_config
    assert precision.get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # the old key name too
    assert not precision.get_float16_config({}).enabled
    with pytest.raises(ConfigError, match=r"bf16\.enabled: expected a boolean"):
        precision.get_bfloat16_config({"bf16": {"enabled": 3}})


def test_parse_range_list_is_strict_as_deepspeeds():
    from shardspeed.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad, message in (
        ("0,2-6,5-9", "overlaps"),
        ("8,2-6", "precedes"),
        ("1,6-2", "runs backwards"),
        ("x", "not a core"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_range_list(bad)


def test_log_level_as_deepspeed_reads_and_keeps_it():
    import shardspeed
    from shardspeed.config import ConfigError

    config = shardspeed.runtime.config
    assert config.get_log_level({}) is None and shardspeed.runtime.constants.LOG_LEVEL_DEFAULT is None
    assert config.get_log_level({"log_level": "DEBUG"}) == "DEBUG"
    assert config.get_log_level({"log_level": "error"}) == "ERROR"  # any case; kept as logging names it
    with pytest.raises(ConfigError, match="log_level: must be one of"):
        config.get_log_level({"log_level": "loud"})


def test_comms_logger_answers_deepspeeds_queries_without_reordering_records():
    from shardspeed.comm.logger import CommsLogger, trim_mean
    from shardspeed.runtime.throughput import ThroughputTimer
    from shardspeed.utils.timer import ThroughputTimer as deepspeed_path_throughput_timer
    from shardspeed.utils.timer import trim_mean as deepspeed_path_trim_mean

    assert deepspeed_path_trim_mean is trim_mean
    assert deepspeed_path_throughput_timer is ThroughputTimer  # engine.tput_timer's class
    data = [3.0, 1.0, 2.0]
    assert trim_mean(data, 0.1) == 2.0 and data == [3.0, 1.0, 2.0]
    logger = CommsLogger()
    logger.start_profiling_comms()
    assert logger.prof_all is True
    logger.stop_profiling_comms()
    assert logger.prof_all is False
    latencies = [3.0, 1.0, 2.0]
    algbws = [10.0 / x for x in latencies]
    logger.comms_dict = {"all_reduce": {1024: [3, list(latencies), list(algbws), [2 * a for a in algbws]]}}
    summary = logger.get_operation_summary("all_reduce")
    assert summary[1024]["avg_latency_ms"] == 2.0 and summary[1024]["count"] == 3
    stored = logger.get_raw_data()["all_reduce"][1024]
    assert stored[1] == latencies and stored[2] == algbws  # summarising sorted nothing in place
    assert logger.get_operation_names() == ["all_reduce"] and logger.get_total_operations() == 3
    assert logger.get_operation_summary("broadcast") is None
    logger.reset_data()
    assert not logger.has_data()


def test_deepspeed_zero_config_is_the_checked_block_under_deepspeeds_field_names():
    import shardspeed
    from shardspeed.config import ConfigError
    from shardspeed.config.zero import OffloadOptimizerConfig, OffloadParamConfig

    zero_config = shardspeed.runtime.zero.config
    config = zero_config.DeepSpeedZeroConfig(cpu_offload_param=True)  # deprecated form, mapped
    assert isinstance(config.offload_param, OffloadParamConfig) and config.offload_param.device == "cpu"
    assert isinstance(
        zero_config.DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer, OffloadOptimizerConfig
    )
    assert zero_config.DeepSpeedZeroConfig(
        stage3_gather_fp16_weights_on_model_save=True
    ).gather_16bit_weights_on_model_save
    config = zero_config.DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345, stage3_max_reuse_distance=7)
    assert (config.prefetch_bucket_size, config.max_reuse_distance) == (12345, 7)
    assert zero_config.DeepSpeedZeroConfig().offload_param is None
    # deprecations are logged through the logger, as DeepSpeed's class does (ZeRO-3 elastic checkpoints too)
    from shardspeed.utils.logging import logger

    warned = []
    real_warning = logger.warning
    logger.warning = warned.append
    try:
        zero_config.DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
        zero_config.DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)  # DeepSpeed warns at stage 3 only
        zero_config.DeepSpeedZeroConfig(cpu_offload=True)
    finally:
        logger.warning = real_warning
    assert len(warned) == 2 and "ZeRO-3 elastic checkpointing is deprecated" in warned[0], warned
    assert "'zero_optimization.cpu_offload' is deprecated" in warned[1]
    try:  # DeepSpeed's class is a pydantic model: with pydantic installed, its ValidationError
        from pydantic import ValidationError as expected
    except ImportError:
        expected = ConfigError
    with pytest.raises(expected, match=r"zero_optimization\.stage: must be one of") as caught:
        zero_config.DeepSpeedZeroConfig(stage=7)
    assert expected is ConfigError or caught.value.errors()[0]["loc"] == ("stage",)
    assert zero_config.DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    assert not zero_config.DeepSpeedZeroOffloadOptimizerConfig().pipeline
    leaf = shardspeed.runtime.zero.leaf_module_config
    assert leaf.DeepSpeedZeroLeafModuleConfig().classes == list(leaf.DEFAULT_LEAF_MODULE_CLASSES)
    assert leaf.DEFAULT_LEAF_MODULE_NAMES == [] and leaf.DEFAULT_LEAF_MODULE_NAME_SUFFIXES == []


def test_deepspeed_config_resolves_batch_sizes_set_on_it_or_raises_assertion_error():
    import shardspeed

    config = shardspeed.runtime.config.DeepSpeedConfig(
        {"train_batch_size": 2, "gradient_accumulation_steps": 1}
    )
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = (
        32,
        None,
        2,
    )
    config._configure_train_batch_size()
    assert config.train_micro_batch_size_per_gpu == 16
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = (
        33,
        17,
        2,
    )
    with pytest.raises(AssertionError, match="train_batch_size"):
        config._configure_train_batch_size()


def test_pipeline_use_reentrant_false_is_what_runs_and_true_is_refused():
    from shardspeed.config import ConfigError, load_config

    assert (
        load_config({"train_batch_size": 1, "pipeline": {"use_reentrant": False}}).pipeline.use_reentrant
        is False
    )
    with pytest.raises(ConfigError, match=r"pipeline\.use_reentrant: true is not supported"):
        load_config({"train_batch_size": 1, "pipeline": {"use_reentrant": True}})


def test_get_gradient_clipping_reads_the_key_with_deepspeeds_default():
    get_gradient_clipping = _walk("runtime.config.get_gradient_clipping")
    assert get_gradient_clipping({}) == _walk("runtime.constants.GRADIENT_CLIPPING_DEFAULT") == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0.5}) == 0.5
    with pytest.raises(shardspeed.ConfigError, match="gradient_clipping"):
        get_gradient_clipping({"gradient_clipping": -1.0})


def test_move_to_device_moves_nested_tensors_and_in_place_where_the_criterion_says():
    move_to_device = _walk("runtime.utils.move_to_device")
    a, b = torch.ones(2, dtype=torch.float64), torch.zeros(3)
    moved = move_to_device({"x": [a, (b, 7)]}, "meta")
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert moved["x"][1][1] == 7 and a.device.type == "cpu"  # copies; the originals stay
    # a tensor meeting the criterion is moved in place (its storage replaced) and returned itself; the others
    # are copied (only CPU here, and storage cannot be swapped to "meta", so the in-place move stays on CPU)
    in_place = move_to_device([a, b], "cpu", criterion_func=lambda t: t.dtype == torch.float64)
    assert in_place[0] is a
    copied = move_to_device([a, b], "meta", criterion_func=lambda t: False)
    assert copied[0].device.type == "meta" and a.device.type == "cpu"
