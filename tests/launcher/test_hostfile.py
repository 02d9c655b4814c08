"""Hostfile parsing, the include/exclude grammar, resource selection and the world_info encoding."""

import pytest

from shardspeed.launcher import LauncherError
from shardspeed.launcher.hostfile import (
    apply_filters,
    decode_world_info,
    encode_world_info,
    parse_core_list,
    parse_hostfile_text,
    read_hostfile,
    select_resources,
)

POOL = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}


def test_parse_keeps_order_and_skips_comments_and_blanks():
    text = "# cluster\n\nworker-2 slots=4\n  worker-1   slots = 2  # spare\nworker-3 slots=1\n"
    hosts = parse_hostfile_text(text)
    assert hosts == {"worker-2": 4, "worker-1": 2, "worker-3": 1}
    assert list(hosts) == ["worker-2", "worker-1", "worker-3"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\nb slot=2\n", "line 2: 'b slot=2' does not parse"),
        ("a slots=2\nb\n", "line 2: 'b' does not parse"),
        ("a slots=2 trailing\n", "line 1"),
        ("a slots=x\n", "slots must be a whole number"),
        ("a slots=0\n", "slots must be a whole number >= 1"),
        ("a slots=2\n\nb slots=1\na slots=4\n", "line 4: 'a slots=4': host 'a' is listed twice"),
        ("-oProxyCommand=x slots=1\n", "cannot start with '-'"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_parse_errors_name_the_line(text, message):
    with pytest.raises(LauncherError, match=message.replace("(", r"\(")):
        parse_hostfile_text(text, source="hf")


def test_read_hostfile_missing_file(tmp_path):
    with pytest.raises(LauncherError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "nope"))


def test_include_builds_new_pool_in_hostfile_order():
    assert apply_filters(POOL, include="c@a:3,1") == {"a": [1, 3], "c": [0, 1]}
    assert apply_filters(POOL, include="b:2,2,0") == {"b": [0, 2]}
    assert apply_filters(POOL, include="a:0@a:1") == {"a": [0, 1]}
    assert apply_filters(POOL, include="a:0@a") == {"a": [0, 1, 2, 3]}


def test_exclude_removes_slots_and_whole_hosts():
    assert apply_filters(POOL, exclude="a:0,1@c") == {"a": [2, 3], "b": [0, 1, 2, 3]}
    assert apply_filters(POOL, exclude="c:0,1") == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("zz", "", "--include: host 'zz' is not in the hostfile"),
        ("", "a:7", "--exclude: host 'a' has no slot 7"),
        ("a:x", "", "slots of 'a' must be integers"),
        ("a:", "", "bad node spec 'a:'"),
        ("a@@b", "", "bad node spec ''"),
        ("a", "b", "cannot be used together"),
        ("", "a@b@c", "leave no slots"),
    ],
)
def test_filter_errors(include, exclude, message):
    with pytest.raises(LauncherError, match=message):
        apply_filters(POOL, include=include, exclude=exclude)


def test_num_nodes_then_num_gpus():
    assert select_resources(POOL, num_nodes=2) == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert select_resources(POOL, num_gpus=1) == {"a": [0], "b": [0], "c": [0]}
    # Without GPUs a slot is a CPU process, so more than the hostfile lists is allowed.
    assert select_resources(POOL, num_nodes=1, num_gpus=6) == {"a": [0, 1, 2, 3, 4, 5]}
    with pytest.raises(LauncherError, match="only 3 host"):
        select_resources(POOL, num_nodes=4)
    with pytest.raises(LauncherError, match="cannot be combined"):
        select_resources(POOL, include="a", num_gpus=1)


def test_core_list():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    assert parse_core_list("0-1,1") == [0, 1]
    for bad in ("1,a", "5-3", "1-"):
        with pytest.raises(LauncherError, match="--bind_core_list"):
            parse_core_list(bad)


def test_world_info_round_trip_is_deepspeed_format():
    import base64
    import json

    encoded = encode_world_info({"n1": [0, 1], "n2": [2]})
    assert json.loads(base64.urlsafe_b64decode(encoded)) == {"n1": [0, 1], "n2": [2]}
    assert decode_world_info(encoded) == {"n1": [0, 1], "n2": [2]}
    with pytest.raises(LauncherError, match="world_info"):
        decode_world_info("not base64 json")
