"""DeepSpeed's EvoformerAttnBuilder questions that keep their meaning without a build: supported GPU targets
and where CUTLASS's headers are; compiler flags are refused by name."""

from __future__ import annotations

import pytest

from shardspeed.compat.mirrors.op_builder import EvoformerAttnBuilder
from shardspeed.compat.not_offered import NotOfferedError


def _cutlass(root):
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// header\n")
    (root / "tools" / "util" / "include").mkdir(parents=True)
    return root


def test_filter_ccs_keeps_tensor_core_targets():
    assert EvoformerAttnBuilder().filter_ccs(["6.1", "7.0", "8.6+PTX", "9.0"]) == [
        ["7", "0"],
        ["8", "6+PTX"],
        ["9", "0"],
    ]


def test_cutlass_found_from_cutlass_path_checkout_or_include_dir(tmp_path, monkeypatch):
    root = _cutlass(tmp_path / "cutlass")
    expected = [str(root / "include"), str(root / "tools" / "util" / "include")]
    for given in (root, root / "include"):
        monkeypatch.setenv("CUTLASS_PATH", str(given))
        assert EvoformerAttnBuilder().include_paths() == expected
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="does not contain CUTLASS headers"):
        EvoformerAttnBuilder().include_paths()
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_IGNORE)
    assert EvoformerAttnBuilder().include_paths() == []


def test_cutlass_found_on_compiler_include_path_or_missing(tmp_path, monkeypatch):
    root = _cutlass(tmp_path / "prefix")
    for name in ("CUTLASS_PATH", "CUTLASS_ROOT", "CUTLASS_HOME", "CONDA_PREFIX", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH",
                 "CUDA_HOME", "CUDA_PATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CPATH", str(root / "include"))
    builder = EvoformerAttnBuilder()
    monkeypatch.setattr(EvoformerAttnBuilder, "_python_package_cutlass_paths", staticmethod(lambda: []))
    assert builder.include_paths()[0] == str(root / "include")
    monkeypatch.setattr(builder, "_candidate_cutlass_paths", lambda: [tmp_path / "missing"])
    with pytest.raises(RuntimeError, match="Unable to locate CUTLASS"):
        builder.include_paths()


def test_compiler_flags_are_refused_by_name():
    with pytest.raises(NotOfferedError, match="nvcc_args"):
        EvoformerAttnBuilder().nvcc_args()
