"""init_inference on a user's own model (torch only): config, fast decode, caches, continuous batching, tp 2.

The model is tests/inference_models.py's TinyLlama (Hugging Face's Llama layout, written in torch); its own
full-sequence forward, re-run for every token, is the reference for every generated token here.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import shardspeed
from shardspeed.config.errors import ConfigError
from shardspeed.config.inference import InferenceConfig, load_inference_config
from shardspeed.inference.decoder import FastDecoder
from shardspeed.inference.generation import GenerationSettings
from shardspeed.inference.quantize import Int8Linear
from shardspeed.inference.scheduler import BatchRequest, ContinuousBatcher

from harness import run_ranks
from inference_models import DecoderLayer, TinyLlama, greedy_reference

PROMPTS = [[5, 9, 3], [7, 1, 8, 2, 6, 4, 11], [3], [12, 13, 14, 15, 16], [2, 2]]


def test_config_merges_kwargs_and_names_bad_keys():
    cfg = load_inference_config(
        {"dtype": "bf16", "tp": {"tp_size": 1}}, {"max_out_tokens": 64, "kernel_inject": True}
    )
    assert (cfg.dtype, cfg.tp_size, cfg.max_out_tokens, cfg.replace_with_kernel_inject) == (
        "bf16",
        1,
        64,
        True,
    )
    assert load_inference_config(None, {"dtype": torch.float16}).torch_dtype == torch.float16
    assert load_inference_config(None, {"mp_size": 2}).tensor_parallel.tp_size == 2
    assert load_inference_config(None, {}).dtype == "fp16"  # DeepSpeed's default
    defaults = shardspeed.default_inference_config()
    assert defaults["max_out_tokens"] == 1024 and defaults["tensor_parallel"]["tp_size"] == 1
    assert load_inference_config(defaults) == InferenceConfig()  # the defaults load back as themselves
    with pytest.raises(ConfigError, match="dtype: given in config as"):
        load_inference_config({"dtype": "fp16"}, {"dtype": "bf16"})
    with pytest.raises(ConfigError, match=r"mp_size.*contradicts tensor_parallel.tp_size"):
        load_inference_config({"tensor_parallel": {"tp_size": 2}, "mp_size": 4})
    with pytest.raises(ConfigError, match="max_out_token"):
        load_inference_config(None, {"max_out_token": 10})
    with pytest.raises(ConfigError, match=r"tensor_parallel.tp_size"):
        load_inference_config(None, {"tensor_parallel": {"tp_size": 0}})
    with pytest.raises(ConfigError, match="dtype"):
        load_inference_config(None, {"dtype": "fp8"})
    with pytest.raises(ConfigError, match="zero: ZeRO-Inference is not supported"):
        load_inference_config(None, {"zero": {"stage": 3}})


def test_generate_equals_reference_greedy(caplog):
    model = TinyLlama()
    with caplog.at_level(logging.INFO, logger="shardspeed.inference.engine"):
        engine = shardspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True,
                                           max_out_tokens=32)  # fmt: skip
    assert "scaled_dot_product_attention" in caplog.text  # what replaces kernel injection is logged
    assert engine.module is model and isinstance(engine.decoder, FastDecoder)
    ids = torch.tensor([PROMPTS[0], [4, 4, 6]])
    torch.testing.assert_close(engine(ids).logits, model(ids).logits, rtol=0, atol=0)
    out = engine.generate(ids, max_new_tokens=10)
    assert out.shape == (2, 13) and torch.equal(out[:, :3], ids)
    for row in range(2):
        assert out[row, 3:].tolist() == greedy_reference(model, ids[row].tolist(), 10)
    # left padding: each row equals its own unpadded run
    padded = torch.tensor([[0, 0, 0, 0] + PROMPTS[0], PROMPTS[1]])
    mask = (torch.arange(7) >= torch.tensor([[4], [0]])).long()
    out = engine.generate(padded, attention_mask=mask, max_new_tokens=6)
    assert out[0, 7:].tolist() == greedy_reference(model, PROMPTS[0], 6)
    assert out[1, 7:].tolist() == greedy_reference(model, PROMPTS[1], 6)
    # a stop token ends a row; rows that stopped are padded with pad_token_id, as HF generate
    first = greedy_reference(model, PROMPTS[1], 3)
    out = engine.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=8, eos_token_id=first[1])
    assert out[0, 7:].tolist() == first[:2]
    out = engine.generate(torch.tensor([PROMPTS[0]]), max_length=9)  # HF's max_length counts the prompt
    assert out.shape == (1, 9)
    with pytest.raises(ValueError, match="max_out_tokens"):
        engine.generate(ids, max_new_tokens=40)
    # options only the model's own generate has are passed to it (TinyLlama has none: the error says so)
    with pytest.raises(AttributeError, match="generate"):
        engine.generate(ids, max_new_tokens=4, num_beams=2)
    # weights changed after init_inference (fused q/k/v must follow): the answer is still the model's
    model.double()
    out = engine.generate(ids.clone(), max_new_tokens=5)
    assert out[0, 3:].tolist() == greedy_reference(model, PROMPTS[0], 5)


def test_deepspeed_call_runs_the_fast_decode_path():
    """DeepSpeed's usual call, ``init_inference(model, dtype, replace_with_kernel_inject=False)`` then
    ``generate(ids, max_new_tokens=..., do_sample=False, pad_token_id=0)``, is decoded by our loop: TinyLlama
    has no ``generate`` of its own, so a fall-back to the model's would raise here."""
    engine = shardspeed.init_inference(TinyLlama(), dtype=torch.float32, replace_with_kernel_inject=False)
    assert isinstance(engine.decoder, FastDecoder)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert GenerationSettings.unhandled(engine.module, kwargs) == []
    ids = torch.tensor([PROMPTS[1], PROMPTS[3] + [1, 2]])
    out = engine.generate(ids, **kwargs)
    for row in range(2):
        assert out[row, 7:].tolist() == greedy_reference(engine.module, ids[row].tolist(), 6)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = TinyLlama()
    engine = shardspeed.init_inference(model, dtype=torch.float32, max_out_tokens=32)
    ids = torch.tensor([PROMPTS[3]])
    torch.manual_seed(3)
    a = engine.generate(ids, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=8)
    torch.manual_seed(3)
    b = engine.generate(ids, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=8)
    assert torch.equal(a, b) and int(a.max()) < 64
    greedy = engine.generate(ids, max_new_tokens=8)
    assert torch.equal(engine.generate(ids, do_sample=True, top_k=1, max_new_tokens=8), greedy)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(ids, do_sample=True, temperature=0.0)


def test_int8_weights():
    model = TinyLlama()
    reference = model(torch.tensor([PROMPTS[1]])).logits
    engine = shardspeed.init_inference(model, dtype=torch.int8, max_out_tokens=32)
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 7 + 1 and all(m.qweight.dtype == torch.int8 for m in linears)
    logits = engine(torch.tensor([PROMPTS[1]])).logits
    assert (logits - reference).abs().max() / reference.abs().max() < 0.05


def test_checkpoint_loading_into_a_meta_model(tmp_path):
    from shardspeed.checkpoint.consolidate import save_safetensors as save_file

    source = TinyLlama(seed=5)
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    ids = torch.tensor([PROMPTS[1]])
    expected = source(ids).logits
    (tmp_path / "st").mkdir()
    save_file(state, tmp_path / "st" / "model.safetensors")
    torch.save(state, tmp_path / "weights.pt")
    (tmp_path / "ckpt.json").write_text('{"type": "ds_model", "checkpoints": ["weights.pt"]}')
    for checkpoint in (str(tmp_path / "st"), str(tmp_path / "weights.pt"), str(tmp_path / "ckpt.json")):
        with torch.device("meta"):
            model = TinyLlama()
        engine = shardspeed.init_inference(
            model, dtype=torch.float32, checkpoint=checkpoint, max_out_tokens=32
        )
        torch.testing.assert_close(engine(ids).logits, expected, rtol=0, atol=0)
    with torch.device("meta"):
        model = TinyLlama()
    with pytest.raises(ValueError, match="checkpoint: the model is on the meta device"):
        shardspeed.init_inference(model, dtype=torch.float32)
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        shardspeed.init_inference(TinyLlama(), checkpoint=str(tmp_path / "missing"))


def _run(batcher, requests, late=(), after_steps=2):
    for request in requests:
        batcher.submit(request)
    steps = 0
    while batcher.step():
        steps += 1
        if steps == after_steps:
            for request in late:  # join between decode steps
                batcher.submit(request)
    return steps


def test_continuous_batching_over_paged_cache():
    model = TinyLlama()
    engine = shardspeed.init_inference(model, dtype=torch.float32, max_out_tokens=32)
    batcher = ContinuousBatcher(engine.decoder, max_len=32, max_batch=3, block_size=4)
    all_blocks = batcher.cache.free_blocks
    budgets = [9, 4, 12, 6, 3]
    emitted = {}
    requests = []
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        settings = GenerationSettings(max_new_tokens=budget)
        requests.append(
            BatchRequest(prompt, settings, emit=lambda t, r, i=i: emitted.setdefault(i, []).append((t, r)))
        )
    _run(batcher, requests[:2], late=requests[2:])
    for i, request in enumerate(requests):
        assert request.generated == greedy_reference(model, PROMPTS[i], budgets[i]), i
        assert [t for t, _ in emitted[i]] == request.generated and emitted[i][-1][1] == "length"
    assert batcher.max_running_seen == 3  # requests of different lengths shared one batch
    assert batcher.cache.free_blocks == all_blocks and batcher.idle  # everything handed back
    # a stop token ends a request at once; a cancelled one leaves and frees its blocks
    stop_at = greedy_reference(model, PROMPTS[1], 3)[2]
    stopping = BatchRequest(
        PROMPTS[1], GenerationSettings(max_new_tokens=10, eos_token_ids=[stop_at]), emit=lambda t, r: None
    )
    cancelled = BatchRequest(PROMPTS[0], GenerationSettings(max_new_tokens=20), emit=lambda t, r: None)
    batcher.submit(stopping)
    batcher.submit(cancelled)
    batcher.step()
    batcher.cancel(cancelled)
    while batcher.step():
        pass
    assert stopping.finish_reason == "stop" and stopping.generated == greedy_reference(model, PROMPTS[1], 3)
    assert cancelled.finish_reason == "cancelled" and batcher.cache.free_blocks == all_blocks
    with pytest.raises(ValueError, match=r"max_tokens.*exceeds the model's context of 32"):
        batcher.submit(BatchRequest(PROMPTS[1], GenerationSettings(max_new_tokens=30), emit=None))
    # a small pool: the third request waits for blocks instead of failing half-way
    small = ContinuousBatcher(engine.decoder, max_len=32, max_batch=3, block_size=4, num_blocks=6)
    requests = [
        BatchRequest(PROMPTS[i], GenerationSettings(max_new_tokens=8), emit=lambda t, r: None)
        for i in (0, 2, 4)
    ]
    _run(small, requests)
    assert small.max_running_seen == 2
    assert [r.generated for r in requests] == [greedy_reference(model, PROMPTS[i], 8) for i in (0, 2, 4)]


def _tp_job():
    import torch.distributed as dist

    from shardspeed.comm.init import init_distributed
    from shardspeed.mii.engine_loop import EngineLoop

    init_distributed(dist_backend="gloo")
    results = {}
    reference = TinyLlama(layers=2)
    model = TinyLlama(layers=2)
    full = sum(p.numel() for n, p in model.named_parameters() if "layers" in n and p.dim() == 2)
    engine = shardspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                       injection_policy={DecoderLayer: ("o_proj", "down_proj")},
                                       max_out_tokens=32)  # fmt: skip
    local = sum(p.numel() for n, p in model.named_parameters() if "layers" in n and p.dim() == 2)
    results["fraction"] = local / full
    ids = torch.tensor([PROMPTS[1], [1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        results["logits_diff"] = float((engine(ids).logits - reference(ids).logits).abs().max())
    out = engine.generate(ids, max_new_tokens=8)
    results["generate_ok"] = all(
        out[r, 7:].tolist() == greedy_reference(reference, ids[r].tolist(), 8) for r in range(2)
    )
    # the server's loop in lockstep: rank 0 drives, rank 1 follows
    batcher = ContinuousBatcher(engine.decoder, max_len=32, max_batch=4, block_size=4)
    loop = EngineLoop(batcher, engine.mp_group, idle_s=0.01)
    if dist.get_rank() == 0:
        done = threading.Semaphore(0)
        requests = [BatchRequest(p, GenerationSettings(max_new_tokens=6), emit=lambda t, r: r and done.release())
                    for p in PROMPTS]  # fmt: skip
        loop.start()
        for request in requests:
            loop.submit(request)
        for _ in requests:
            assert done.acquire(timeout=60)
        loop.stop()
        results["loop_ok"] = [r.generated for r in requests] == [
            greedy_reference(reference, p, 6) for p in PROMPTS
        ]
    else:
        loop.follow()
    with pytest.raises(ValueError, match=r"int8.*not supported together with tensor parallelism"):
        shardspeed.init_inference(TinyLlama(), tensor_parallel={"tp_size": 2}, dtype="int8",
                                  injection_policy={DecoderLayer: ("o_proj", "down_proj")})  # fmt: skip
    return results


def test_tensor_parallel_with_injection_policy():
    results = run_ranks(_tp_job, 2)
    for rank, result in enumerate(results):
        assert result["logits_diff"] <= 1e-4, (rank, result)
        assert result["generate_ok"], rank
        assert 0.45 < result["fraction"] < 0.55, result
    assert results[0]["loop_ok"]


def _collect(batcher, requests):
    for request in requests:
        batcher.submit(request)
    while batcher.step():
        pass
    return [r.generated for r in requests]


def test_prefix_caching_shares_blocks_and_changes_no_token():
    model = TinyLlama()
    engine = shardspeed.init_inference(model, dtype=torch.float32, max_out_tokens=48)
    system = [3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 1]  # a shared "system prompt" of 3.5 blocks
    prompts = [system + [i, i + 1] for i in range(1, 6)] + [
        system[:8],
        system + list(range(1, 10)),
        system[:4],
    ]
    answers, batchers = {}, {}
    for caching in (False, True):
        batcher = ContinuousBatcher(
            engine.decoder, max_len=48, max_batch=3, block_size=4, prefix_caching=caching
        )
        requests = [
            BatchRequest(p, GenerationSettings(max_new_tokens=6), emit=lambda t, r: None) for p in prompts
        ]
        answers[caching], batchers[caching] = _collect(batcher, requests), batcher
        assert batcher.cache.free_blocks == batcher.cache.num_blocks  # every block back (cached ones count)
        if caching:
            # the first computes the system prompt; the rest reuse its full blocks (never their last token)
            assert [r.cached_tokens for r in requests] == [0, 12, 12, 12, 12, 4, 16, 0]
    assert answers[True] == answers[False] == [greedy_reference(model, p, 6) for p in prompts]
    assert batchers[True].prompt_tokens_computed < batchers[False].prompt_tokens_computed
    # a small pool: cached blocks nobody uses are evicted (oldest first) when fresh blocks are needed
    small = ContinuousBatcher(
        engine.decoder, max_len=48, max_batch=1, block_size=4, num_blocks=12, prefix_caching=True
    )
    first = _collect(
        small, [BatchRequest(prompts[0], GenerationSettings(max_new_tokens=6), emit=lambda t, r: None)]
    )
    other = [list(range(20, 40))]
    assert _collect(
        small, [BatchRequest(other[0], GenerationSettings(max_new_tokens=20), emit=lambda t, r: None)]
    ) == [greedy_reference(model, other[0], 20)]
    again = BatchRequest(prompts[0], GenerationSettings(max_new_tokens=6), emit=lambda t, r: None)
    assert _collect(small, [again]) == first and again.cached_tokens < 12  # its prefix was partly evicted
    assert small.cache.free_blocks == 12


def test_server_sampling_fields():
    from shardspeed.inference.sampling import choose

    model = TinyLlama()
    engine = shardspeed.init_inference(model, dtype=torch.float32, max_out_tokens=32)
    batcher = ContinuousBatcher(engine.decoder, max_len=32, max_batch=4, block_size=4)
    greedy = greedy_reference(model, PROMPTS[1], 8)

    def run(**fields):
        request = BatchRequest(
            PROMPTS[1], GenerationSettings(max_new_tokens=8, **fields), emit=lambda t, r: None
        )
        _collect(batcher, [request])
        return request

    # logit_bias forces a token; a big negative bias forbids the greedy one
    assert run(logit_bias={42: 100.0}).generated == [42] * 8
    assert greedy[0] not in run(logit_bias={greedy[0]: -100.0}).generated[:1]
    # presence/frequency penalties and repetition_penalty change what repeats (a token at most once here)
    banned = run(frequency_penalty=2.0, presence_penalty=2.0, logit_bias={7: 5.0}).generated
    assert banned[0] == 7 and banned.count(7) < 8
    # min tokens: the stop token is masked until then; ignore_eos: it does not stop
    stop = greedy[1]
    assert run(eos_token_ids=[stop]).finish_reason == "stop"
    assert len(run(eos_token_ids=[stop], min_new_tokens=5).generated) >= 5
    assert run(eos_token_ids=[stop], ignore_eos=True).generated == greedy
    # logprobs: the chosen token's log-probability under the model, the top alternatives, greedy = best
    request = run(logprobs=3)
    assert request.generated == greedy and len(request.token_logprobs) == 8
    for choice in request.token_logprobs:
        assert choice.top[0] == (choice.token, choice.logprob) and len(choice.top) == 3
    with torch.no_grad():
        all_logprobs = torch.log_softmax(model(torch.tensor([PROMPTS[1]])).logits[0], -1)
    reference = all_logprobs[-1]
    assert abs(request.token_logprobs[0].logprob - float(reference[greedy[0]])) < 1e-5
    echoed = run(logprobs=0, prompt_logprobs=True)
    expected = [float(all_logprobs[t, PROMPTS[1][t + 1]]) for t in range(len(PROMPTS[1]) - 1)]
    assert [c.logprob for c in echoed.prompt_choices] == pytest.approx(expected, abs=1e-5)
    # what validation lets through must not break sampling: a tiny temperature is greedy, extreme values finite
    assert run(do_sample=True, temperature=1e-300).generated == greedy
    extreme = GenerationSettings(
        do_sample=True, temperature=1e-5, top_p=5e-324, repetition_penalty=5e-324, top_k=1
    )
    assert (
        0 <= choose(torch.randn(64) * 1e30, extreme, [1, 2], [3], torch.Generator().manual_seed(0)).token < 64
    )
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationSettings(repetition_penalty=0.0).check()


def test_a_failing_request_ends_alone():
    model = TinyLlama()
    engine = shardspeed.init_inference(model, dtype=torch.float32, max_out_tokens=32)
    batcher = ContinuousBatcher(engine.decoder, max_len=32, max_batch=4, block_size=4)
    forward = batcher._forward_decode

    def faulty(batch):  # the decode step fails whenever the poisoned request is in it, alone or not
        if any(r.seed == 99 and len(r.generated) >= 2 for r in batch):
            raise RuntimeError("injected decode fault")
        return forward(batch)

    batcher._forward_decode = faulty
    events = {}
    requests = [
        BatchRequest(p, GenerationSettings(max_new_tokens=6), emit=lambda t, r, i=i: events.setdefault(i, []).append(r), seed=s)
        for i, (p, s) in enumerate([(PROMPTS[0], None), (PROMPTS[1], 99), (PROMPTS[3], None)])
    ]  # fmt: skip
    # and one whose sampling fails (a bias that excludes every token)
    bad_sampling = BatchRequest(
        PROMPTS[2], GenerationSettings(max_new_tokens=6, logit_bias={}), emit=lambda t, r: None
    )
    bad_sampling.settings.logit_bias = {t: float("-inf") for t in range(64)}
    _collect(batcher, [*requests, bad_sampling])
    assert requests[1].finish_reason == "error" and "injected decode fault" in requests[1].error
    assert (
        events[1][-1] == "error"
        and bad_sampling.finish_reason == "error"
        and "excluded" in bad_sampling.error
    )
    for i in (0, 2):
        assert requests[i].generated == greedy_reference(model, requests[i].prompt_ids, 6)
    assert batcher.failed_count == 2 and batcher.cache.free_blocks == batcher.cache.num_blocks


def test_text_stream_holds_back_stop_strings_and_partial_characters():
    from shardspeed.mii.text import TextStream

    class Bytes:  # a byte-level tokenizer: token id = byte value
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    def stream(text: str, stops):
        out = TextStream(Bytes(), stops)
        pieces = [out.add(b) for b in text.encode()]
        return pieces, out

    pieces, out = stream("héllo\n\nworld", ["\n\n"])
    assert "".join(pieces) == "héllo" and out.stopped and "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # the two bytes of é go out together
    assert pieces[6] == ""  # "\n" might start the stop string: held back
    pieces, out = stream("a\nb", ["\n\n"])
    assert "".join(pieces) == "a\nb" and not out.stopped  # released once it cannot be the stop string
    pieces, out = stream("abc", ["c", "xyz"])
    assert "".join(pieces) + out.finish() == "ab" and out.stopped
    pieces, out = stream("abx", ["xyz"])
    assert "".join(pieces) == "ab" and out.finish() == "x"  # held back, then released at the end


def test_serve_command_help_and_missing_extra():
    """`shardspeed-serve --help` needs no extra; without one, the command names the missing package."""
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "shardspeed.mii.server", "--help"], capture_output=True, text=True
    )
    assert shown.returncode == 0 and "--api-key" in shown.stdout and "--no-prefix-caching" in shown.stdout
    hidden = "import sys; sys.modules['fastapi'] = None; from shardspeed.mii.server import main; sys.exit(main(['x']))"
    missing = subprocess.run([sys.executable, "-c", hidden], capture_output=True, text=True)
    assert missing.returncode == 2 and "fastapi" in missing.stderr and "shardspeed[serve]" in missing.stderr
