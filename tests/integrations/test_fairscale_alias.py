"""The `fairscale` alias distribution (integrations/fairscale-alias): FairScale's import paths on shardspeed.

Runs in fresh interpreters with the alias's source folder on PYTHONPATH (where `pip install` puts the same
package), so the test needs nothing installed. The issue's examples run unchanged through `import fairscale`
on 2 Gloo ranks (fairscale_job.py) and reach single-process training's parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from harness import free_port

ROOT = Path(__file__).resolve().parents[2]
ALIAS = ROOT / "integrations" / "fairscale-alias"

CHECK_TABLE = textwrap.dedent(
    """
    import importlib
    import fairscale
    from shardspeed.compat.fairscale_paths import FAIRSCALE_PATHS
    from shardspeed.compat.not_offered import NotOffered, NotOfferedError
    assert fairscale.__version__.startswith("0.4.13"), fairscale.__version__
    for path, entry in FAIRSCALE_PATHS.items():
        module_path, _, name = ("fairscale." + path).rpartition(".")
        value = getattr(importlib.import_module(module_path), name)
        if isinstance(entry, NotOffered):
            target = getattr(value, "Anything") if entry.module else value  # module: its names are stand-ins
            try:
                target()
            except NotOfferedError as error:
                assert f"fairscale.{path}" in str(error), (path, str(error))
            else:
                raise AssertionError(f"{path}: a stand-in did not refuse")
        else:
            module_name, attribute = entry.split(":")
            assert value is getattr(importlib.import_module(module_name), attribute), path
    from fairscale.optim.oss import OSS
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.nn import ShardedDataParallel as also
    assert also is ShardedDataParallel
    try:
        from fairscale.optim import NotAName  # noqa: F401
    except ImportError as error:
        assert "NotAName" in str(error)
    else:
        raise AssertionError("an unknown name imported")
    print("ok")
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ALIAS), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_every_table_path_imports_through_the_alias():
    done = subprocess.run([sys.executable, "-c", CHECK_TABLE], env=_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_the_issue_examples_run_unchanged_on_two_ranks():
    job = Path(__file__).with_name("fairscale_job.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(job)]  # fmt: skip
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parity ok" in done.stdout
