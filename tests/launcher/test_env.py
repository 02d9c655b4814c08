"""Which variables travel to other nodes, and the .deepspeed_env / .shardspeed_env / DS_ENV_FILE files."""

import pytest

from shardspeed.launcher import LauncherError
from shardspeed.launcher.env import env_file_paths, exported_env, parse_env_file_text


def test_prefixes_and_names_are_exported_others_are_not(tmp_path):
    environ = {
        "NCCL_DEBUG": "INFO",
        "PYTHONHASHSEED": "0",
        "UCX_TLS": "tcp",
        "MV2_X": "1",
        "MLFLOW_RUN": "r",
        "GLOO_SOCKET_IFNAME": "lo",
        "DLTS_JOB_ID": "7",
        "HOME": "/root",
        "SECRET_TOKEN": "x",
        "PYTHONPATH": "/opt/lib",
    }
    out = exported_env(environ, cwd=str(tmp_path), home=str(tmp_path / "home"))
    for name in (
        "NCCL_DEBUG",
        "PYTHONHASHSEED",
        "UCX_TLS",
        "MV2_X",
        "MLFLOW_RUN",
        "GLOO_SOCKET_IFNAME",
        "DLTS_JOB_ID",
    ):
        assert out[name] == environ[name]
    assert "HOME" not in out and "SECRET_TOKEN" not in out
    assert out["PYTHONPATH"] == f"{tmp_path}:/opt/lib"  # working directory first, as DeepSpeed does


def test_aisc_jobs_do_not_copy_device_names(tmp_path):
    environ = {"AISC_JOB_NAME": "j", "NCCL_IB_HCA": "mlx5", "UCX_NET_DEVICES": "x", "NCCL_DEBUG": "WARN"}
    out = exported_env(environ, cwd=str(tmp_path), home=str(tmp_path))
    assert "NCCL_IB_HCA" not in out and "UCX_NET_DEVICES" not in out and out["NCCL_DEBUG"] == "WARN"


def test_env_files_home_then_cwd_later_wins(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nB=cwd\n")
    (cwd / ".shardspeed_env").write_text("export C='x y'\nD=a=b=c\nE=\"$(id); rm -rf /\"\n")
    out = exported_env({}, cwd=str(cwd), home=str(home))
    assert (out["A"], out["B"], out["C"], out["D"]) == ("home", "cwd", "x y", "a=b=c")
    assert out["E"] == "$(id); rm -rf /"  # kept verbatim: never given to a shell unquoted


def test_ds_env_file_replaces_default_names(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("A=default\n")
    custom = tmp_path / "custom.env"
    custom.write_text("A=custom\n")
    assert env_file_paths({"DS_ENV_FILE": str(custom)}, str(tmp_path), str(tmp_path / "h")) == [str(custom)]
    assert (
        exported_env({"DS_ENV_FILE": str(custom)}, cwd=str(tmp_path), home=str(tmp_path / "h"))["A"]
        == "custom"
    )


def test_env_file_bad_line_names_file_and_line():
    with pytest.raises(LauncherError, match=r"f line 2: 'not a setting' is not NAME=value"):
        parse_env_file_text("A=1\nnot a setting\n", "f")
    with pytest.raises(LauncherError, match="line 1"):
        parse_env_file_text("1A=1\n", "f")
