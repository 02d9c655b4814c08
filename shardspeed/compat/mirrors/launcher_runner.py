"""DeepSpeed's `deepspeed.launcher.multinode_runner.MultiNodeRunner`: the base class of a multi-node runner.

DeepSpeed's launcher picks one of its own runner classes (PDSH, OpenMPI, MPICH, Slurm, ...) by the
`--launcher` name; shardspeed's launcher builds the same backends' commands without classes
(shardspeed/launcher/multinode.py), so DeepSpeed's concrete runners stay refused by name. The base class is
offered because code subclasses it to build a backend's command line itself (DeepSpeed's tests do): it keeps
the parsed arguments, the user's script and arguments, and the variables to export, quoting a value the
way a shell command line needs it. Neither launcher picks up a subclass: `deepspeed --launcher` still
chooses among the backends it knows.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

__all__ = ["MultiNodeRunner"]

# Characters a value may hold and still pass unquoted through the remote shell (DeepSpeed's rule): a
# SLURM value such as `64(x2)` holds parentheses and must be quoted, a path such as PYTHONPATH must not,
# since quotes around it would become part of the value on some launchers.
_SAFE_VALUE = re.compile(r"[\w@%+=:,./-]*")


class MultiNodeRunner(ABC):
    """`args` as the launcher parsed them (`user_script`, `user_args`); `world_info_base64` the encoded
    host -> slots map the per-node launcher reads."""

    def __init__(self, args, world_info_base64):
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether this backend's program is installed here."""

    @abstractmethod
    def get_cmd(self, environment, active_resources):
        """The command that starts the job on the nodes of `active_resources`."""

    def add_export(self, key: str, var: str) -> None:
        """Export `key=var` to every rank; a value holding shell-special characters is double-quoted."""
        var = var.strip()
        if not _SAFE_VALUE.fullmatch(var):
            var = f'"{var}"'
        self.exports[key.strip()] = var

    def parse_user_args(self):
        return self.args.user_args

    @property
    def name(self) -> str:
        """The backend's name: the class's."""
        return type(self).__name__

    def validate_args(self) -> None:
        """Check `self.args` for this backend (nothing to check in the base class)."""
        return None

    @classmethod
    def validate_active_resources(cls, active_resources) -> None:
        """Check an --include/--exclude filter against what this backend can express (any, in the base)."""
        return None
