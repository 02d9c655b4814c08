"""DeepSpeed's op builders (`deepspeed.ops.op_builder`), answering that nothing needs building.

DeepSpeed compiles C++/CUDA extensions through these classes (`CPUAdamBuilder().load()`), and code asks
them whether an op can run (`CPUAdamBuilder().is_compatible()`, `deepspeed.ops.__compatible_ops__`). In
shardspeed nothing is compiled: the ops DeepSpeed builds for its optimizers and NVMe I/O are pure PyTorch
here, so their builders say they are compatible and already installed. `load()` returns an object that
names the Python class to use instead of the extension's raw functions (their C++ entry points do not
exist). Builders of kernels shardspeed does not offer (fused transformer layers, quantizers, sparse
attention, ...) say they are not compatible, and `load()` raises NotOfferedError naming the op.
"""

from __future__ import annotations

from shardspeed.compat.mirrors.op_builder.evoformer_questions import EvoformerBuildQuestions
from shardspeed.compat.not_offered import NotOfferedError

__all__ = ["ALL_OPS", "COMPATIBLE_OPS", "OpBuilder"]

# op name -> what serves it in shardspeed (None: not offered)
_SERVED_BY = {
    "cpu_adam": "shardspeed.ops.adam.DeepSpeedCPUAdam (torch's fused CPU Adam)",
    "fused_adam": "shardspeed.ops.adam.FusedAdam (torch's fused/foreach Adam)",
    "cpu_adagrad": "shardspeed.ops.adagrad.DeepSpeedCPUAdagrad (torch's Adagrad)",
    "cpu_lion": "shardspeed.ops.lion.DeepSpeedCPULion (pure PyTorch)",
    "fused_lion": "shardspeed.ops.lion.FusedLion (pure PyTorch)",
    "fused_lamb": "shardspeed.ops.lamb.FusedLamb (pure PyTorch)",
    "async_io": "shardspeed.zero.swap.aio.AsyncFileIO (a thread pool over preadv/pwritev, O_DIRECT)",
    "pin_memory": "torch.Tensor.pin_memory",
}

_BUILDERS = {
    # class name: op name (DeepSpeed's)
    "CPUAdamBuilder": "cpu_adam",
    "FusedAdamBuilder": "fused_adam",
    "CPUAdagradBuilder": "cpu_adagrad",
    "CPULionBuilder": "cpu_lion",
    "FusedLionBuilder": "fused_lion",
    "FusedLambBuilder": "fused_lamb",
    "AsyncIOBuilder": "async_io",
    "PinMemoryBuilder": "pin_memory",
    "GDSBuilder": "gds",
    "TransformerBuilder": "transformer",
    "StochasticTransformerBuilder": "stochastic_transformer",
    "InferenceBuilder": "transformer_inference",
    "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops",
    "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops",
    "QuantizerBuilder": "quantizer",
    "FPQuantizerBuilder": "fp_quantizer",
    "SparseAttnBuilder": "sparse_attn",
    "SpatialInferenceBuilder": "spatial_inference",
    "RandomLTDBuilder": "random_ltd",
    "EvoformerAttnBuilder": "evoformer_attn",
    "FlashAttentionBuilder": "flash_attn",
    "DeepCompileBuilder": "dc",
    "UtilsBuilder": "utils",
    "CCLCommBuilder": "deepspeed_ccl_comm",
    "ShareMemCommBuilder": "deepspeed_shm_comm",
    "NotImplementedBuilder": "deepspeed_not_implemented",
}

ALL_OPS = {name: None for name in _BUILDERS.values()}  # DeepSpeed: op name -> builder instance
COMPATIBLE_OPS = {name: name in _SERVED_BY for name in ALL_OPS}  # `deepspeed.ops.__compatible_ops__`


class _PythonOp:
    """What `load()` returns for an op shardspeed serves in Python: it names that class, and any attribute
    (a compiled function of DeepSpeed's extension) raises NotOfferedError saying so."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise NotOfferedError(
            f"the compiled {self._name} extension's {attribute!r} does not exist in shardspeed (nothing is "
            f"compiled); the op is served by {_SERVED_BY[self._name]}"
        )

    def __repr__(self) -> str:
        return f"<{self._name}: served by {_SERVED_BY[self._name]}>"


class OpBuilder:
    """DeepSpeed's builder interface: `NAME`, `is_compatible()`, `load()`, `builder()`, `absolute_name()`."""

    NAME = "deepspeed_not_implemented"
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def sources(self) -> list[str]:
        return []  # nothing to compile

    def include_paths(self) -> list[str]:
        return []

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.name in _SERVED_BY

    def load(self, verbose: bool = True) -> _PythonOp:
        if self.name not in _SERVED_BY:
            raise NotOfferedError(
                f"the {self.name} op ({type(self).__name__}) is not offered by shardspeed: it is a compiled "
                f"kernel and shardspeed compiles nothing"
            )
        return _PythonOp(self.name)

    def jit_load(self, verbose: bool = True) -> _PythonOp:
        return self.load(verbose)

    def builder(self):
        raise NotOfferedError(f"{type(self).__name__}.builder(): shardspeed builds no C++/CUDA extensions")


# builders that answer more of DeepSpeed's questions than OpBuilder does: class name -> mixin
_QUESTIONS = {"EvoformerAttnBuilder": EvoformerBuildQuestions}


def _builder_class(class_name: str, op_name: str) -> type:
    build_var = "DS_BUILD_" + op_name.upper()
    doc = f"DeepSpeed's {class_name} ({op_name!r}): " + (
        f"served by {_SERVED_BY[op_name]}" if op_name in _SERVED_BY else "not offered (a compiled kernel)"
    )
    bases = (_QUESTIONS[class_name], OpBuilder) if class_name in _QUESTIONS else (OpBuilder,)
    return type(class_name, bases, {"NAME": op_name, "BUILD_VAR": build_var, "__doc__": doc})


for _class_name, _op_name in _BUILDERS.items():
    globals()[_class_name] = _builder_class(_class_name, _op_name)
    ALL_OPS[_op_name] = globals()[_class_name]()
__all__ += sorted(_BUILDERS)
