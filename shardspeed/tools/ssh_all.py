"""`ds_ssh` / `shardspeed-ssh`: run one shell command on every host of a hostfile, as DeepSpeed's `ds_ssh`.

    ds_ssh [-f /job/hostfile] nvidia-smi

With `pdsh` installed it runs `pdsh -w host1,host2 <command>` over ssh, as DeepSpeed's script does. Without
it (DeepSpeed then gives up), shardspeed runs `ssh <host> <command>` for all hosts at once and prefixes each
output line with `host: `, as pdsh does. The exit code is the largest of the hosts'. The hostfile is read
with the launcher's parser, so a bad line is an error naming it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading

from shardspeed.launcher import LauncherError
from shardspeed.launcher.hostfile import read_hostfile

__all__ = ["build_parser", "main"]

DEFAULT_HOSTFILE = "/job/hostfile"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_ssh", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "-f", "--hostfile", default=DEFAULT_HOSTFILE, help=f"hostfile (default {DEFAULT_HOSTFILE})"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, run on every host")
    return p


def _relay(host: str, stream, sink) -> None:
    for line in stream:
        sink.write(f"{host}: {line}")
        sink.flush()


def _over_ssh(hosts: list[str], command: str) -> int:
    """`ssh host command` on every host at once; output prefixed with the host, as pdsh does."""
    procs = []
    for host in hosts:
        proc = subprocess.Popen(["ssh", "-o", "BatchMode=yes", host, command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        relay = threading.Thread(target=_relay, args=(host, proc.stdout, sys.stdout), daemon=True)
        relay.start()
        procs.append((proc, relay))
    codes = []
    for proc, relay in procs:
        codes.append(proc.wait())
        relay.join()
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.command:
        raise SystemExit("ds_ssh: no command given (usage: ds_ssh [-f hostfile] <command>)")
    try:
        hosts = list(read_hostfile(args.hostfile))
    except LauncherError as error:
        raise SystemExit(f"ds_ssh: {error}") from None
    command = " ".join(args.command)  # as DeepSpeed's script passes $@: the remote shell reads the words
    print(f"hostfile={args.hostfile}", flush=True)
    if shutil.which("pdsh"):
        env = {**os.environ, "PDSH_RCMD_TYPE": "ssh"}
        return subprocess.call(["pdsh", "-w", ",".join(hosts), command], env=env)
    if not shutil.which("ssh"):
        raise SystemExit("ds_ssh: neither pdsh nor ssh is installed")
    return _over_ssh(hosts, command)


if __name__ == "__main__":
    sys.exit(main())
