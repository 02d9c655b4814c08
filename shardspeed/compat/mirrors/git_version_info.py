"""DeepSpeed's `deepspeed.git_version_info`: the version, build facts and which ops are installed.

DeepSpeed writes this module at build time; its test harness and `ds_report` read `torch_info` and
`installed_ops`. Here every op shardspeed serves counts as installed, since nothing needs building
(shardspeed/compat/mirrors/op_builder.py), and `torch_info` describes the torch actually imported.
"""

from __future__ import annotations

import torch

from shardspeed.compat.mirrors.op_builder import COMPATIBLE_OPS
from shardspeed.version import __git_branch__, __git_hash__, __version__

__all__ = [
    "accelerator_name",
    "compatible_ops",
    "git_branch",
    "git_hash",
    "installed_ops",
    "torch_info",
    "version",
]

version = __version__
git_hash = __git_hash__
git_branch = __git_branch__
installed_ops = dict(COMPATIBLE_OPS)
compatible_ops = dict(COMPATIBLE_OPS)


def _major_minor(text: str | None) -> str:
    return ".".join((text or "0.0").split("+")[0].split(".")[:2])


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return "0.0"
    major, minor, *_ = torch.cuda.nccl.version()
    return f"{major}.{minor}"


torch_info = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}


def _accelerator_name() -> str:
    from shardspeed.accelerator import has_cuda

    return "cuda" if has_cuda() else "cpu"


accelerator_name = _accelerator_name()
