"""Which environment variables a job carries to its ranks on other nodes.

A remote shell starts with a fresh environment, so the launcher sends along (as DeepSpeed does) every
variable whose name starts with one of `EXPORT_PREFIXES`, a few exact names used by job schedulers, and
the `KEY=VALUE` lines of `.deepspeed_env` / `.shardspeed_env` in the home directory and then the working
directory (later files win), or of the file named by `DS_ENV_FILE` instead.

Differences from DeepSpeed, on purpose: blank lines and `#` comments in env files are skipped, an
`export ` prefix is accepted, one pair of matching quotes around a value is removed (as a shell would),
and a line that is not `NAME=value` is an error naming the file and line. Values are never given to a
shell unquoted: callers pass them in argv (`env K=V`, `-x K=V`) or through `shlex.quote`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from shardspeed.launcher import LauncherError

# DeepSpeed's list (MLFLOW, PYTHON, MV2, UCX, plus NCCL for CUDA), the other accelerators' collective
# libraries, Gloo's, and our own/DeepSpeed's settings (e.g. DEEPSPEED_TIMEOUT, SHARDSPEED_ACCELERATOR).
EXPORT_PREFIXES = (
    "NCCL",
    "GLOO",  # GLOO_SOCKET_IFNAME is to Gloo what NCCL_SOCKET_IFNAME is to NCCL
    "TP_",
    "PYTHON",
    "UCX",
    "MV2",
    "MLFLOW",
    "NEBULA",
    "AZUREML",
    "CCL",
    "FI_",
    "HCCL",
    "RCCL",
    "HIP_",
    "ROCR_",
    "SHARDSPEED_",
    "DEEPSPEED_",
    "DS_",
    "TORCH_",
    "OMP_",
)
EXPORT_NAMES = ("DLTS_JOB_ID", "DLTS_NUM_WORKER", "AML_RUN_ID")
# On AISC jobs the devices differ from node to node, so these must not be copied from the launching node.
_AISC_SKIP = ("NCCL_IB_HCA", "UCX_NET_DEVICES")
ENV_FILE_NAMES = (".deepspeed_env", ".shardspeed_env")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env_file_text(text: str, source: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise LauncherError(f"{source} line {number}: {raw.strip()!r} is not NAME=value")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def env_file_paths(environ: Mapping[str, str], cwd: str, home: str) -> list[str]:
    """Candidate env files in the order they are applied (later wins); only existing ones are read."""
    names = [environ["DS_ENV_FILE"]] if environ.get("DS_ENV_FILE") else list(ENV_FILE_NAMES)
    paths: list[str] = []
    for directory in (home, cwd):
        for name in names:
            path = os.path.join(directory, os.path.expanduser(name))  # an absolute name stays as is
            if os.path.isfile(path) and path not in paths:
                paths.append(path)
    return paths


def read_env_files(environ: Mapping[str, str], cwd: str, home: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for path in env_file_paths(environ, cwd, home):
        try:
            with open(path, encoding="utf-8") as handle:
                values.update(parse_env_file_text(handle.read(), path))
        except OSError as err:
            raise LauncherError(f"cannot read env file {path}: {err.strerror}") from None
    return values


def exported_env(
    environ: Mapping[str, str] | None = None, cwd: str | None = None, home: str | None = None
) -> dict[str, str]:
    """The variables to set on every node: matching names from `environ`, then the env files' lines.

    `PYTHONPATH` gets the working directory prepended, so `import my_module` works on every node as it
    does where the job was started.
    """
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    home = os.path.expanduser("~") if home is None else home
    exported = {
        name: value
        for name, value in environ.items()
        if (name.startswith(EXPORT_PREFIXES) or name in EXPORT_NAMES)
        and not ("AISC_JOB_NAME" in environ and name in _AISC_SKIP)
    }
    python_path = environ.get("PYTHONPATH", "")
    exported["PYTHONPATH"] = cwd + (os.pathsep + python_path if python_path else "")
    exported.update(read_env_files(environ, cwd, home))
    return exported
