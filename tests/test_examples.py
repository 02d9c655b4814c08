"""The README's main job runs under torchrun and under plain `python` (a world of one); the Evoformer example
trains on two ranks and its block equals the plain-attention version."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "12", "--dim", "32", "--layers", "1", "--seq", "32", "--corpus_bytes", "200000"]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _losses(output: str) -> tuple[float, float]:
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", output)
    assert match, output[-2000:]
    return float(match.group(1)), float(match.group(2))


@pytest.mark.parametrize("config", ["gpt_small.json", "gpt_fp16.json"])
def test_example_under_torchrun(config):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "examples/train_gpt.py", "--deepspeed_config", f"examples/configs/{config}", *SMALL]  # fmt: skip
    output = _run(cmd)
    first, last = _losses(output)
    assert last < first  # it learns
    assert "2 processes" in output


def test_example_under_plain_python(tmp_path):
    output = _run([sys.executable, "examples/train_gpt.py", "--deepspeed_config", "examples/configs/gpt_small.json",
                   "--save_dir", str(tmp_path), *SMALL])  # fmt: skip
    assert "1 processes" in output
    assert (tmp_path / "latest").read_text() == "global_step12"


def test_example_turns_on_checkpointing_monitor_profiler_and_comms_logger(tmp_path):
    config = json.loads((ROOT / "examples/configs/gpt_observe.json").read_text())
    config["csv_monitor"]["output_path"] = str(tmp_path)
    path = tmp_path / "observe.json"
    path.write_text(json.dumps(config))
    output = _run([sys.executable, "examples/train_gpt.py", "--deepspeed_config", str(path), *SMALL])
    first, last = _losses(output)
    assert last < first
    assert "Profile Summary at step 2:" in output  # the flops profiler's report
    assert "Comm. Op" in output and "all_gather_into_tensor" in output  # the comms logger's table
    lines = (tmp_path / "gpt" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert lines[0] == "step,train_loss" and len(lines) == 1 + 12


def _evoformer_model_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "evoformer_example_model", ROOT / "examples/evoformer/model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evoformer_example_trains_with_zero2_bf16_and_checkpointing_on_two_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "examples/evoformer/train.py",
           "--deepspeed_config", "examples/evoformer/ds_config.json", "--steps", "15", "--n_seq", "6", "--n_res", "24"]  # fmt: skip
    output = _run(cmd)
    assert "2 processes, ZeRO stage 2, torch.bfloat16, attention evoformer, checkpointing True" in output
    first, last = _losses(output)
    assert last < first - 0.5  # it learns (chance level is ln 20 + ln 2 = 3.69)


def test_evoformer_example_block_equals_the_plain_attention_version():
    """Every attention of the block (row with pair bias, column, both triangle attentions: transposed,
    strided inputs) through DS4Sci_EvoformerAttention gives the plain model's loss and gradients."""
    import torch

    model_module = _evoformer_model_module()
    torch.manual_seed(0)
    ours = model_module.Evoformer(blocks=1, attention="evoformer")
    plain = model_module.Evoformer(blocks=1, attention="plain")
    for p in ours.parameters():  # OpenFold-style zero-initialised outputs would hide the attention's part
        torch.nn.init.normal_(p, std=0.3)
    plain.load_state_dict(ours.state_dict())
    dataset = model_module.SyntheticMSA(size=2, n_seq=5, n_res=18)
    batch = {key: torch.stack([dataset[0][key], dataset[1][key]]) for key in dataset[0]}
    losses = []
    for module in (ours, plain):
        loss = module(batch)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
