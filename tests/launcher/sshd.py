"""A throw-away OpenSSH server on loopback for the multi-node launcher tests.

Two host aliases, node1 -> 127.0.0.2 and node2 -> 127.0.0.3, on one free port, with a host key and a user
key generated in a temporary directory. The launcher is pointed at the generated ssh config through
SHARDSPEED_SSH_CONFIG; the user's own ~/.ssh is never touched. Only the sshd started here is stopped.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

HOSTS = {"node1": "127.0.0.2", "node2": "127.0.0.3"}


@dataclass
class LoopbackSshd:
    directory: str
    port: int
    config: str  # ssh client config (for -F / SHARDSPEED_SSH_CONFIG)
    process: subprocess.Popen

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def missing_tools() -> list[str]:
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    return [
        name
        for name, found in (
            ("sshd", sshd),
            ("ssh", shutil.which("ssh")),
            ("ssh-keygen", shutil.which("ssh-keygen")),
        )
        if not found
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return sock.getsockname()[1]


def _write(path: str, text: str, mode: int = 0o600) -> None:
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)


def _wait_listening(port: int, process: subprocess.Popen, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if all(_accepts(address, port) for address in HOSTS.values()):
            return True
        time.sleep(0.05)
    return False


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def start(directory: str) -> LoopbackSshd:
    """Start sshd; raises RuntimeError with sshd's log if it does not come up."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    for kind in ("host", "user"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{directory}/{kind}_key"], check=True
        )
    shutil.copy(f"{directory}/user_key.pub", f"{directory}/authorized_keys")
    os.chmod(f"{directory}/authorized_keys", 0o600)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    user = getpass.getuser()
    last_error = ""
    for _attempt in range(3):  # the free port can be taken between choosing and binding it
        port = _free_port()
        listen = "\n".join(f"ListenAddress {address}:{port}" for address in HOSTS.values())
        _write(
            f"{directory}/sshd_config",
            f"{listen}\nHostKey {directory}/host_key\nPidFile {directory}/sshd.pid\n"
            f"AuthorizedKeysFile {directory}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "X11Forwarding no\nAllowTcpForwarding no\nPrintMotd no\nLogLevel ERROR\n",
        )
        aliases = "".join(f"Host {name}\n  HostName {address}\n" for name, address in HOSTS.items())
        _write(
            f"{directory}/ssh_config",
            f"{aliases}Host *\n  Port {port}\n  User {user}\n  IdentityFile {directory}/user_key\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  BatchMode yes\n",
        )
        log = open(f"{directory}/sshd.log", "w")  # noqa: SIM115 (sshd keeps it for its lifetime)
        process = subprocess.Popen(
            [sshd, "-D", "-e", "-f", f"{directory}/sshd_config"],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        if _wait_listening(port, process):
            return LoopbackSshd(directory, port, f"{directory}/ssh_config", process)
        process.kill()
        process.wait()
        with open(f"{directory}/sshd.log") as handle:
            last_error = handle.read()[-2000:]
    raise RuntimeError(f"sshd did not start: {last_error}")
