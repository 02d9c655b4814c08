"""Fixtures for the launcher tests: a per-test output directory for probe ranks and the loopback sshd."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from . import sshd


@pytest.fixture
def probe_out(tmp_path: Path) -> Path:
    out = tmp_path / "ranks"
    out.mkdir()
    return out


@pytest.fixture(scope="session")
def loopback_sshd(tmp_path_factory):
    """A real sshd on 127.0.0.2/127.0.0.3 (aliases node1/node2); skips with the reason if it cannot run."""
    missing = sshd.missing_tools()
    if missing:
        pytest.skip(f"OpenSSH not installed ({', '.join(missing)} missing); run .ci/setup-launchers.sh")
    try:
        server = sshd.start(str(tmp_path_factory.mktemp("sshd")))
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot start a loopback sshd here: {err}")
    yield server
    server.stop()
