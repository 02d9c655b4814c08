"""A pytest plugin for benchmarks/deepspeed_unit_tests.py: a time limit per test, inside its forked child.

DeepSpeed's harness waits for its rank processes without a limit once a test has failed in some ways, and
pytest-timeout cannot help under `--forked` (its timer runs in the parent, and ending or interrupting the
parent ends the whole file). Here the forked child arms an alarm when the test starts and, when it rings,
writes why and exits with code 124: pytest-forked reports that one test as failed and the file goes on.
The rank processes the test left behind are killed by the runner when the file is done.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest


def pytest_addoption(parser) -> None:
    parser.addoption("--per-test-limit", type=float, default=0.0, help="seconds per test (0: no limit)")


def _expire(signum, frame) -> None:
    sys.stderr.write("\nconformance: the test ran past its time limit\n")
    sys.stderr.flush()
    os._exit(124)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    limit = item.config.getoption("per_test_limit")
    if limit and os.getpid() != item.config._conformance_parent:  # only in the forked child
        signal.signal(signal.SIGALRM, _expire)
        signal.alarm(max(1, int(limit)))


def pytest_configure(config) -> None:
    config._conformance_parent = os.getpid()
