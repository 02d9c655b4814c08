"""docs/configuration.md lists every key the config system accepts."""

import dataclasses
import typing
from pathlib import Path

from shardspeed.config import ConfigWarning, ShardspeedConfig
from shardspeed.config.build import _schema

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _blocks(tp):
    for arg in typing.get_args(tp):
        yield from _blocks(arg)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        yield tp


def _all_keys(cls, path=""):
    schema = _schema(cls)
    for name, hint in schema.hints.items():
        full = f"{path}.{name}" if path else name
        yield full
        for block in _blocks(hint):
            yield from _all_keys(block, full)


def test_every_key_is_documented():
    text = DOCS.read_text()
    missing = [key for key in _all_keys(ShardspeedConfig) if f"`{key.rsplit('.', 1)[-1]}`" not in text]
    assert missing == []


def test_every_block_has_a_documented_section():
    text = DOCS.read_text()
    blocks = {key for key in _all_keys(ShardspeedConfig) if f"### `{key}`" in text}
    assert {"zero_optimization", "zero_optimization.offload_param", "fp16", "checkpoint"} <= blocks


def test_key_tables_are_generated_from_the_schema():
    # docs/config_tables.py writes the "Every key" section; rerun it after changing a config block.
    import subprocess
    import sys

    script = DOCS.parent / "config_tables.py"
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0, (
        "docs/configuration.md's key tables are out of date: run python docs/config_tables.py"
    )


def test_config_warning_is_a_user_warning():
    assert issubclass(ConfigWarning, UserWarning)
