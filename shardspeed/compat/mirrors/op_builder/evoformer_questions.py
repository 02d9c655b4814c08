"""What DeepSpeed's EvoformerAttnBuilder answers about a build environment, for code that asks it.

shardspeed's Evoformer attention (shardspeed/ops/deepspeed4science) is PyTorch and needs neither CUTLASS
nor a compiler, so nothing here builds anything. Two questions keep their meaning without a build and are
answered as DeepSpeed's builder answers them: which GPU targets the Evoformer kernel supports
(`filter_ccs`: Tensor Core capable, compute capability 7.0 and up) and where this machine's CUTLASS headers
are (`include_paths`, looked up in CUTLASS_PATH, the nvidia-cutlass package, install prefixes and the
compiler's include paths, in DeepSpeed's order). Compiler flags (`nvcc_args`) are refused by name.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from shardspeed.compat.not_offered import NotOfferedError
from shardspeed.utils.logging import logger

__all__ = ["EvoformerBuildQuestions"]

_PREFIX_VARIABLES = ("CUTLASS_ROOT", "CUTLASS_HOME", "CONDA_PREFIX", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH", "CUDA_HOME",
                     "CUDA_PATH")  # fmt: skip
_INCLUDE_VARIABLES = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")
_FIXED_PLACES = (Path("/usr/local/cutlass"), Path("/opt/cutlass"), Path("/usr/local"), Path("/usr"))


def _paths_in(variables) -> list[Path]:
    return [
        Path(entry) for name in variables for entry in os.environ.get(name, "").split(os.pathsep) if entry
    ]


class EvoformerBuildQuestions:
    """Mixed into the EvoformerAttnBuilder of the op_builder mirror. `cutlass_path` is CUTLASS_PATH as it was
    when the builder was made; two special values say how to find CUTLASS: `CUTLASS_IGNORE` (do not look,
    the compiler knows) and `CUTLASS_PYTHON_BINDINGS` (only in the nvidia-cutlass package)."""

    CUTLASS_IGNORE = "DS_IGNORE_CUTLASS_DETECTION"
    CUTLASS_PYTHON_BINDINGS = "DS_USE_CUTLASS_PYTHON_BINDINGS"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.cutlass_path = os.environ.get("CUTLASS_PATH")

    def warning(self, message: str) -> None:
        logger.warning(f"{type(self).__name__}: {message}")

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """The targets among `ccs` ("7.0", "8.0+PTX", ...) the kernel supports, split as [major, minor]."""
        split = [cc.split(".") for cc in ccs]
        dropped = [cc for cc in split if int(cc[0]) < 7]
        if dropped:
            self.warning(f"Evoformer: excluding targets below SM 7.0: {dropped}. Tensor Core required.")
        return [cc for cc in split if int(cc[0]) >= 7]

    def nvcc_args(self):
        raise NotOfferedError(f"{type(self).__name__}.nvcc_args(): shardspeed compiles nothing; its Evoformer "
                              "attention is PyTorch (shardspeed.ops.deepspeed4science)")  # fmt: skip

    # -- where CUTLASS is --------------------------------------------------------------------------------------
    @staticmethod
    def _python_package_cutlass_paths() -> list[Path]:
        """Where the nvidia-cutlass package (module cutlass_library) keeps CUTLASS, if installed."""
        try:
            package = importlib.import_module("cutlass_library")
        except ImportError:
            return []
        places = [Path(package.source_path)] if getattr(package, "source_path", None) else []
        if getattr(package, "__file__", None):
            folder = Path(package.__file__).resolve().parent
            places += [folder / "source", folder.parent, folder]
        return places

    def _candidate_cutlass_paths(self) -> list[Path]:
        if self.cutlass_path == self.CUTLASS_PYTHON_BINDINGS:
            places = self._python_package_cutlass_paths()
            if not places:
                raise ImportError("Unable to locate CUTLASS from the nvidia-cutlass Python package")
            return places
        if self.cutlass_path:
            return [Path(self.cutlass_path)]
        prefixes = [Path(sys.prefix), Path(sys.exec_prefix), Path(sys.base_prefix)]
        places = [
            *self._python_package_cutlass_paths(),
            *_paths_in(_PREFIX_VARIABLES),
            *prefixes,
            *_paths_in(_INCLUDE_VARIABLES),
            Path.cwd() / "cutlass",
            *_FIXED_PLACES,
        ]
        return list(dict.fromkeys(place.expanduser() for place in places))

    @staticmethod
    def _cutlass_include_dirs(place: Path) -> list[str]:
        """[include root, tools/util/include if present] when `place` is a CUTLASS checkout or its include dir."""
        place = place.expanduser().resolve()
        if (place / "include" / "cutlass" / "cutlass.h").is_file():
            root, util = place / "include", place / "tools" / "util" / "include"
        elif (place / "cutlass" / "cutlass.h").is_file():
            root, util = place, place.parent / "tools" / "util" / "include"
        else:
            return []
        return [str(root)] + ([str(util)] if util.is_dir() else [])

    def include_paths(self) -> list[str]:
        """CUTLASS's include folders on this machine; [] when told not to look (CUTLASS_IGNORE)."""
        if self.cutlass_path == self.CUTLASS_IGNORE:
            return []
        for place in self._candidate_cutlass_paths():
            found = self._cutlass_include_dirs(place)
            if found:
                return found
        if self.cutlass_path:
            raise RuntimeError(f"CUTLASS_PATH {self.cutlass_path} does not contain CUTLASS headers")
        raise RuntimeError(
            "Unable to locate CUTLASS: install nvidia-cutlass or set CUTLASS_PATH to a CUTLASS checkout"
        )
