"""Every module path of the DeepSpeed 0.19.8 wheel imports through the `deepspeed` alias.

tests/deepspeed_0_19_8_modules.txt lists them (one per .py file of the wheel). Each must import as
shardspeed's module where shardspeed has one, or as a stand-in module whose names raise NotOfferedError
naming the DeepSpeed path when used (shardspeed/compat/paths.py). So neither a DeepSpeed test file nor a
framework probing DeepSpeed's modules dies at import. Runs in a fresh interpreter with the alias staged, as
`pip install` would lay it out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from .alias_path import env_with_alias

MODULES_FILE = Path(__file__).resolve().parents[1] / "deepspeed_0_19_8_modules.txt"

# Paths whose DeepSpeed meaning (universal checkpoints, reading DeepSpeed's checkpoint folders, the sequence
# parallel state of Ulysses) is being built under issue 36 with the features themselves. Until then each of
# them may only be missing outright (ModuleNotFoundError naming that path), never fail in another way.
BUILT_WITH_THEIR_FEATURE = {
    "checkpoint.affine",
    "checkpoint.affine_transfer",
    "checkpoint.autoep_affine",
    "checkpoint.autoep_universal",
    "checkpoint.autoep_zero3_metadata",
    "checkpoint.constants",
    "checkpoint.deepspeed_checkpoint",
    "checkpoint.reshape_3d_utils",
    "checkpoint.reshape_meg_2d",
    "checkpoint.reshape_utils",
    "checkpoint.universal_checkpoint",
    "checkpoint.zero_checkpoint",
    "runtime.sequence_parallel.parallel_state_sp",
}

IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, sys, types
    from shardspeed.compat.not_offered import NotOfferedError, NotOfferedModule
    paths, pending = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
    problems, kinds = [], {"shardspeed": 0, "stand-in": 0, "pending": 0}
    for path in paths:
        name = "deepspeed." + path
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if path in pending and error.name == name:
                kinds["pending"] += 1
            else:
                problems.append(f"{path}: {type(error).__name__}: {error}")
            continue
        except Exception as error:
            problems.append(f"{path}: {type(error).__name__}: {error}")
            continue
        if not isinstance(module, types.ModuleType) or not module.__name__.startswith("shardspeed"):
            problems.append(f"{path}: imports as {module!r}, not a shardspeed module")
        elif isinstance(module, NotOfferedModule):
            kinds["stand-in"] += 1
            try:
                module.SomeDeepSpeedName()
                problems.append(f"{path}: a stand-in name did not raise")
            except NotOfferedError as error:
                if f"deepspeed.{path}.SomeDeepSpeedName is not offered by shardspeed: " not in str(error):
                    problems.append(f"{path}: the stand-in does not name itself: {error}")
        else:
            kinds["shardspeed"] += 1
    print(json.dumps({"problems": problems, "kinds": kinds}))
    """
)


def test_every_module_path_of_deepspeed_0_19_8_imports_through_the_alias(tmp_path):
    paths = [
        line.strip()
        for line in MODULES_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(paths) == 750 and len(set(paths)) == len(paths)
    assert set(paths) >= BUILT_WITH_THEIR_FEATURE
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(paths), json.dumps(sorted(BUILT_WITH_THEIR_FEATURE))],
        env={**env_with_alias(tmp_path / "alias"), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["problems"] == []
    kinds = report["kinds"]
    assert sum(kinds.values()) == len(paths)
    assert kinds["shardspeed"] > 100  # most of what users import is shardspeed's own module
