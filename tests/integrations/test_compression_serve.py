"""A compressed, cleaned and packed Hugging Face Llama served from its packed file: `init_inference` on a
meta-device model, `mii.pipeline` and `shardspeed-serve` compute what the cleaned model does; the example
script runs end to end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.mii.tokenizer import END_OF_TEXT, byte_tokenizer

from harness import free_port

pytest.importorskip("transformers", reason="the hf/serve extra is not installed (integration stage only)")

from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {
    "q_proj": 64,
    "k_proj": 32,
    "v_proj": 32,
    "o_proj": 64,
    "gate_proj": 128,
    "up_proj": 128,
    "down_proj": 64,
}


def _config(bits: int, runs_per_row: int, qtype: str) -> dict:
    groups = {key: {"params": {"start_bits": bits, "target_bits": bits, "quantize_groups": rows * runs_per_row},
                    "modules": [rf"\.{key}$"]} for key, rows in SHAPES.items()}  # fmt: skip
    return {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": qtype, "quantize_weight_in_forward": True}, "different_groups": groups}}}  # fmt: skip


@pytest.fixture(scope="module", params=[(8, 1, "symmetric"), (4, 2, "asymmetric"), (2, 1, "symmetric")],
                ids=["int8", "int4", "ternary"])  # fmt: skip
def packed(request, tmp_path_factory):
    from shardspeed.compression import export_packed
    from shardspeed.compression.compress import init_compression, redundancy_clean
    from shardspeed.compression.scheduler import compression_scheduler

    bits, runs, qtype = request.param
    path = tmp_path_factory.mktemp(f"packed{bits}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=END_OF_TEXT + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=END_OF_TEXT, pad_token_id=END_OF_TEXT,
                         tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    compression = _config(bits, runs, qtype)
    init_compression(model, compression)
    compression_scheduler(model, compression).step(step_zero_check=True)
    redundancy_clean(model, compression)
    size = export_packed(model, path / "model.safetensors")
    model.config.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path, model, size, fp32_bytes, bits


def test_init_inference_loads_the_packed_file(packed):
    import shardspeed
    from shardspeed.compression.packed import PackedLinear

    path, cleaned, size, fp32_bytes, _ = packed
    assert size < 0.5 * fp32_bytes
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(path))
    engine = shardspeed.init_inference(model, checkpoint=str(path), dtype=torch.float32)
    packed_layers = [m for m in engine.module.modules() if isinstance(m, PackedLinear)]
    assert len(packed_layers) == 14
    ids = torch.randint(0, END_OF_TEXT, (2, 12))
    with torch.no_grad():
        expected = cleaned(input_ids=ids).logits
    assert torch.allclose(engine(ids).logits, expected, atol=1e-5)
    for layer in packed_layers:  # the served model holds codes and scales, not fp32 weights
        held = sum(t.numel() * t.element_size() for t in layer.packed.buffers())
        fp32 = layer.in_features * layer.out_features * 4
        assert held <= fp32 * layer.packed.storage_bits / 32 + layer.out_features * layer.packed.blocks * 8
    out = engine.generate(ids[:1], max_new_tokens=8, do_sample=False)
    reference = cleaned.generate(
        ids[:1], max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids[:1])
    )
    assert torch.equal(out, reference)


def test_pipeline_and_server_serve_the_packed_directory(packed):
    httpx = pytest.importorskip("httpx", reason="the serve extra is not installed (integration stage only)")
    pytest.importorskip("fastapi", reason="the serve extra is not installed (integration stage only)")
    from shardspeed import mii
    from shardspeed.mii.pipeline import pipeline  # (mii.pipeline is the submodule once that is imported)

    path, cleaned, _, _, bits = packed
    if bits != 8:  # one server start is enough; the pipeline runs for every width
        pipe = pipeline(str(path))
        assert pipe(["def "], max_new_tokens=12)[0].generated_length == 12
        return
    pipe = pipeline(str(path))
    text = pipe(["def "], max_new_tokens=12)[0].generated_text
    ids = torch.tensor([byte_tokenizer()("def ")["input_ids"]])
    reference = cleaned.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    assert text == byte_tokenizer().decode(reference[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    port = free_port()
    client = mii.serve(str(path), deployment_name="packed", restful_api_port=port, timeout=600)
    try:
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                              json={"model": "packed", "prompt": "def ", "max_tokens": 12,
                                    "temperature": 0})  # greedy, as the pipeline (OpenAI's default is 1)  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == text
    finally:
        client.terminate_server()


def test_example_compresses_cleans_exports_and_serves(tmp_path):
    cmd = [sys.executable, "examples/compress_gpt.py", "--deepspeed_config", "examples/configs/compress_ternary.json",
           "--teacher", str(tmp_path / "teacher"), "--out", str(tmp_path / "ternary"), "--teacher_steps", "2",
           "--steps", "2", "--corpus_bytes", "120000", "--eval_windows", "8"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    match = re.search(r"compressed (\d+\.\d+), cleaned (\d+\.\d+), served (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    compressed, cleaned, served = (float(x) for x in match.groups())
    assert compressed == cleaned and abs(served - cleaned) < 1e-3
    assert (tmp_path / "ternary" / "model.safetensors").stat().st_size < 0.1 * (
        tmp_path / "teacher" / "model.safetensors"
    ).stat().st_size
