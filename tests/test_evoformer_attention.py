"""DS4Sci_EvoformerAttention (shardspeed.ops.deepspeed4science) against the plain reference.

Parity: output and the gradients of Q, K, V and both biases equal the plain attention (whole logits,
softmax, autograd) within 1e-5 in fp32 and 1e-10 in fp64, for several shapes, with zero, one and two biases,
unchunked and chunked over sequences and query rows, with both per-block kernels. Half precision: within
1e-2 (bf16) / 2e-3 (fp16) of the exact result (fp64 on the same rounded inputs), relative to its largest
entry; the plain half-precision reference is itself 0.4-1.3e-2 (bf16) / 0.5-1.2e-3 (fp16) off on these cases.
Memory: allocator events recorded by torch.profiler (exact and repeatable) show that the blockwise op never
holds more than a few blocks of logits, where the plain one holds the whole [B, S, H, R, R] several times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention, EvoformerFusedAttention
from shardspeed.ops.deepspeed4science.chunking import CHUNK_MB_ENV, WORKING_COPIES, plan_chunks
from shardspeed.ops.deepspeed4science.reference import evoformer_attention_reference

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# peak bytes live at once, from the CPU allocator's events as torch.profiler records them (exact, repeatable)
from benchmarks.evoformer_cases import tracked_peak_bytes  # noqa: E402

# [batch, n_seq, n_res, heads, dim]
SHAPES = [(1, 5, 20, 3, 8), (2, 3, 17, 2, 16), (1, 4, 33, 4, 32)]
BIASES = {"none": (), "mask": ("mask",), "pair": (None, "pair"), "both": ("mask", "pair")}
BLOCKS = {  # keyword arguments of DS4Sci_EvoformerAttention
    "unchunked": {"chunk_size": 64},
    "default": {},
    "seq1": {"chunk_size": 1},
    "seq2-rows7": {"chunk_size": 2, "query_chunk_size": 7},
}


def _inputs(shape, dtype=torch.float32, mask_value=-30.0, seed=0):
    batch, n_seq, n_res, heads, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    keep = torch.rand(batch, n_seq, 1, 1, n_res, generator=g) < 0.8
    mask = (~keep).float() * mask_value
    pair = torch.randn(batch, 1, heads, n_res, n_res, generator=g)
    grad_out = torch.randn(shape, generator=g)
    return [t.to(dtype) for t in (q, k, v, mask, pair)], grad_out.to(dtype)


def _biases(kind, mask, pair):
    return [{"mask": mask, "pair": pair, None: None}[name] for name in BIASES[kind]]


def _run(fn, tensors, kind, grad_out):
    """Output and gradients of every input that took part, of fn(Q, K, V, biases)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    q, k, v, mask, pair = leaves
    biases = _biases(kind, mask, pair)
    out = fn(q, k, v, biases)
    used = [q, k, v, *(b for b in biases if b is not None)]
    return [out, *torch.autograd.grad(out, used, grad_out)]


def _assert_all_close(ours, ref, tol):
    names = ["out", "dQ", "dK", "dV", "dbias0", "dbias1"]
    for name, a, b in zip(names, ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize("kind", list(BIASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_output_and_gradients_equal_the_plain_reference(shape, kind, blocks, backend):
    tensors, grad_out = _inputs(shape)
    ref = _run(evoformer_attention_reference, tensors, kind, grad_out)
    ours = _run(
        lambda *a: DS4Sci_EvoformerAttention(*a, backend=backend, **BLOCKS[blocks]), tensors, kind, grad_out
    )
    _assert_all_close(ours, ref, 1e-5)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_fp64_parity_is_exact_to_rounding(backend):
    tensors, grad_out = _inputs((2, 3, 19, 2, 8), dtype=torch.float64)
    ref = _run(evoformer_attention_reference, tensors, "both", grad_out)
    fn = lambda *a: DS4Sci_EvoformerAttention(*a, backend=backend, chunk_size=2, query_chunk_size=5)  # noqa: E731
    _assert_all_close(_run(fn, tensors, "both", grad_out), ref, 1e-10)


def test_deepspeed_style_mask_of_minus_1e9():
    """DeepSpeed's own test builds the mask bias as 1e9 * (mask - 1)."""
    tensors, grad_out = _inputs((1, 6, 24, 4, 16), mask_value=-1e9)
    ref = _run(evoformer_attention_reference, tensors, "both", grad_out)
    _assert_all_close(_run(DS4Sci_EvoformerAttention, tensors, "both", grad_out), ref, 1e-5)


HALF_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 6, 24, 2, 16), (2, 3, 40, 4, 8)], ids=lambda s: "x".join(map(str, s)))
def test_half_precision_stays_within_the_stated_tolerance(shape, dtype, backend):
    tensors, grad_out = _inputs(shape, dtype=dtype, mask_value=-1e9)
    exact = _run(evoformer_attention_reference, [t.double() for t in tensors], "both", grad_out.double())
    fn = lambda *a: DS4Sci_EvoformerAttention(*a, backend=backend, chunk_size=2)  # noqa: E731
    ours = _run(fn, tensors, "both", grad_out)
    for name, a, b in zip(["out", "dQ", "dK", "dV", "dmask", "dpair"], ours, exact):
        assert a.dtype == dtype, name
        error = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert error < HALF_TOLERANCE[dtype], (name, error)


def test_only_the_gradients_asked_for_are_computed_and_they_are_right():
    tensors, grad_out = _inputs((1, 4, 20, 2, 8))
    q, k, v, mask, pair = tensors
    q.requires_grad_()
    pair.requires_grad_()
    out = DS4Sci_EvoformerAttention(q, k, v, [mask, pair], chunk_size=1)
    dq, dpair = torch.autograd.grad(out, [q, pair], grad_out)
    ref_q, ref_pair = q.detach().clone().requires_grad_(), pair.detach().clone().requires_grad_()
    ref = evoformer_attention_reference(ref_q, k, v, [mask, ref_pair])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip((dq, dpair), torch.autograd.grad(ref, [ref_q, ref_pair], grad_out)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_double_backward_is_refused():
    tensors, grad_out = _inputs((1, 2, 8, 2, 4))
    q = tensors[0].requires_grad_()
    out = DS4Sci_EvoformerAttention(q, *tensors[1:3], [])
    (dq,) = torch.autograd.grad(out, q, grad_out.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        dq.sum().backward()


def test_inference_without_grad_and_non_contiguous_inputs():
    tensors, _ = _inputs((2, 3, 16, 2, 8))
    q, k, v, mask, pair = tensors
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    with torch.no_grad():
        out = DS4Sci_EvoformerAttention(q_strided, k, v, [mask, pair], chunk_size=2)
    torch.testing.assert_close(
        out, evoformer_attention_reference(q, k, v, [mask, pair]), rtol=1e-5, atol=1e-5
    )
    assert out.is_contiguous() and not out.requires_grad


def test_deepspeed_calling_forms_and_the_biases_list_is_left_alone():
    tensors, _ = _inputs((1, 3, 18, 2, 8))
    q, k, v, mask, pair = tensors
    biases = [mask]
    out = DS4Sci_EvoformerAttention(q, k, v, biases)
    assert biases == [mask]  # DeepSpeed appends None to the caller's list; we do not
    torch.testing.assert_close(out, EvoformerFusedAttention.apply(q, k, v, mask), rtol=0, atol=0)
    torch.testing.assert_close(
        EvoformerFusedAttention.apply(q, k, v, mask, pair),
        evoformer_attention_reference(q, k, v, [mask, pair]),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        DS4Sci_EvoformerAttention(q, k, v, (None, None)), DS4Sci_EvoformerAttention(q, k, v, [])
    )


def test_the_deepspeed_import_path_names_the_same_objects():
    import shardspeed

    assert shardspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention is DS4Sci_EvoformerAttention


# ---- block sizes --------------------------------------------------------------------------------------


def test_blocks_are_sized_from_the_memory_target():
    shape = (1, 32, 256, 4, 32)  # one sequence's logits: 4 heads x 256 x 256 x 4 bytes = 1 MiB
    per_sequence = WORKING_COPIES * 2**20
    plan = plan_chunks(shape, 4, target_bytes=8 * 2**20)
    assert plan.seq_chunk == 8 * 2**20 // per_sequence == 2 and plan.query_chunk == 256
    assert plan_chunks(shape, 4, target_bytes=2**40).seq_chunk == 32  # everything fits: one block
    rows = plan_chunks(shape, 4, target_bytes=2**20)  # one sequence is over the target: split its rows
    assert rows.seq_chunk == 1 and rows.query_chunk == 2**20 // (WORKING_COPIES * 4 * 256 * 4) == 85
    explicit = plan_chunks(shape, 4, target_bytes=2**20, chunk_size=5, query_chunk_size=300)
    assert (explicit.seq_chunk, explicit.query_chunk) == (5, 256)
    assert plan.seq_slices(5) == [(0, 2), (2, 4), (4, 5)]


def test_default_target_per_device():
    from shardspeed.ops.deepspeed4science.chunking import memory_target_bytes

    assert memory_target_bytes(2**20, "cpu") == 8 * 2**20  # the floor
    assert memory_target_bytes(2**30, "cpu") == 2**30  # the bytes of Q
    assert memory_target_bytes(2**20, "cuda") == 256 * 2**20  # GPUs: larger blocks, fewer kernel launches
    assert memory_target_bytes(2**20, "mps") == 8 * 2**20


def test_environment_target_changes_the_blocks(monkeypatch):
    from shardspeed.ops.deepspeed4science.evoformer_attn import AttentionOptions

    q = torch.empty(1, 32, 256, 4, 32)
    kernel = AttentionOptions().kernel_for(q.device)
    assert AttentionOptions().plan_for(q, kernel).seq_chunk == 2  # default: max(8 MiB, bytes of Q)
    monkeypatch.setenv(CHUNK_MB_ENV, "24")
    assert AttentionOptions().plan_for(q, kernel).seq_chunk == 8
    monkeypatch.setenv(CHUNK_MB_ENV, "0.5")
    assert AttentionOptions().plan_for(q, kernel).query_chunk < 256
    for bad in ("lots", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(CHUNK_MB_ENV, bad)
        with pytest.raises(ValueError, match=f"{CHUNK_MB_ENV} must be a positive number of MiB, got '{bad}'"):
            AttentionOptions().plan_for(q, kernel)


def test_blockwise_attention_never_holds_the_whole_logits():
    shape = batch, n_seq, n_res, heads, _ = (1, 16, 96, 2, 16)
    tensors, grad_out = _inputs(shape)
    leaves = [t.requires_grad_() for t in tensors]
    logits = batch * n_seq * heads * n_res * n_res * 4  # bytes of the whole fp32 logits

    def step(fn):
        def run():
            for t in leaves:
                t.grad = None
            fn(*leaves[:3], leaves[3:]).backward(grad_out)

        run()  # warm-up, so lazily created state is not counted
        return tracked_peak_bytes(run)

    # the output and dQ, dK, dV, the pair bias's gradient, the saved log-sum-exp and the mask's gradient
    unavoidable = 4 * leaves[0].nbytes + leaves[4].nbytes + 2 * logits // n_res
    plain = step(evoformer_attention_reference)
    ours = step(lambda q, k, v, b: DS4Sci_EvoformerAttention(q, k, v, b, chunk_size=1, backend="math"))
    one_block = logits // n_seq
    assert plain >= 3 * logits
    assert ours <= unavoidable + WORKING_COPIES * one_block, (ours, unavoidable, one_block)
    assert ours < 0.3 * plain


# ---- refused inputs -----------------------------------------------------------------------------------


def _good():
    (q, k, v, mask, pair), _ = _inputs((1, 3, 10, 2, 4))
    return q, k, v, mask, pair


def _call(q, k, v, biases, **kwargs):
    return DS4Sci_EvoformerAttention(q, k, v, biases, **kwargs)


BAD_INPUTS = {
    "Q not a tensor": (lambda q, k, v, m, p: _call(q.tolist(), k, v, []), TypeError, "Q must be a torch.Tensor, got list"),
    "Q 4-D": (lambda q, k, v, m, p: _call(q[0], k[0], v[0], []), ValueError,
              r"Q must have 5 dimensions \[batch, n_seq, n_res, heads, dim\], got shape \(3, 10, 2, 4\)"),
    "Q empty": (lambda q, k, v, m, p: _call(q[:, :0], k[:, :0], v[:, :0], []), ValueError,
                r"Q has shape \(1, 0, 10, 2, 4\) .*every dimension must be at least 1"),
    "K shape": (lambda q, k, v, m, p: _call(q, k[:, :2], v, []), ValueError,
                r"K has shape \(1, 2, 10, 2, 4\) but Q has \(1, 3, 10, 2, 4\)"),
    "V shape": (lambda q, k, v, m, p: _call(q, k, v[..., :3], []), ValueError,
                r"V has shape \(1, 3, 10, 2, 3\) but Q has \(1, 3, 10, 2, 4\)"),
    "Q int dtype": (lambda q, k, v, m, p: _call(q.long(), k.long(), v.long(), []), TypeError,
                    "Q has dtype torch.int64; supported: float32, bfloat16, float16"),
    "K dtype": (lambda q, k, v, m, p: _call(q, k.half(), v, []), TypeError,
                "K has dtype torch.float16 but Q has torch.float32"),
    "V dtype": (lambda q, k, v, m, p: _call(q, k, v.bfloat16(), []), TypeError,
                "V has dtype torch.bfloat16 but Q has torch.float32"),
    "V device": (lambda q, k, v, m, p: _call(q, k, v.to("meta"), []), ValueError,
                 "V is on meta but Q is on cpu"),
    "mask shape": (lambda q, k, v, m, p: _call(q, k, v, [m[:, :, 0]]), ValueError,
                   r"biases\[0\] is the mask bias \[batch, n_seq, 1, 1, n_res\]: for Q of shape \(1, 3, 10, 2, 4\) "
                   r"it must have shape \(1, 3, 1, 1, 10\), got \(1, 3, 1, 10\)"),
    "pair in the mask's place": (lambda q, k, v, m, p: _call(q, k, v, [p]), ValueError,
                                 r"got \(1, 1, 2, 10, 10\) \(a pair bias alone goes in as \[None, pair_bias\]\)"),
    "pair shape": (lambda q, k, v, m, p: _call(q, k, v, [m, p.expand(1, 3, 2, 10, 10)]), ValueError,
                   r"biases\[1\] is the pair bias .* must have shape \(1, 1, 2, 10, 10\), got \(1, 3, 2, 10, 10\)"),
    "mask dtype": (lambda q, k, v, m, p: _call(q, k, v, [m.double()]), TypeError,
                   r"biases\[0\] has dtype torch.float64 but Q has torch.float32"),
    "pair device": (lambda q, k, v, m, p: _call(q, k, v, [m, p.to("meta")]), ValueError,
                    r"biases\[1\] is on meta but Q is on cpu"),
    "bias not a tensor": (lambda q, k, v, m, p: _call(q, k, v, [m, 1.0]), TypeError,
                          r"biases\[1\] must be a torch.Tensor or None, got float"),
    "biases not a list": (lambda q, k, v, m, p: _call(q, k, v, m), TypeError,
                          "biases must be a list of at most two tensors"),
    "three biases": (lambda q, k, v, m, p: _call(q, k, v, [m, p, p]), ValueError,
                     r"biases holds 3 entries; at most two: \[mask_bias, pair_bias\]"),
    "chunk_size 0": (lambda q, k, v, m, p: _call(q, k, v, [], chunk_size=0), ValueError,
                     "chunk_size must be a positive int or None, got 0"),
    "chunk_size float": (lambda q, k, v, m, p: _call(q, k, v, [], chunk_size=2.0), ValueError,
                         "chunk_size must be a positive int or None, got 2.0"),
    "query_chunk_size bool": (lambda q, k, v, m, p: _call(q, k, v, [], query_chunk_size=True), ValueError,
                              "query_chunk_size must be a positive int or None, got True"),
    "backend": (lambda q, k, v, m, p: _call(q, k, v, [], backend="cutlass"), ValueError,
                "backend must be one of auto, math, sdpa; got 'cutlass'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_with_an_error_naming_it(case):
    call, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        call(*_good())


# ---- CUDA (skipped without a GPU) ---------------------------------------------------------------------

CUDA_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["auto", "math", "sdpa"])
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", [(1, 4, 33, 4, 32), (2, 3, 64, 2, 64)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_matches_the_exact_reference(shape, dtype, backend):
    """On the GPU (auto = SDPA per block) with a residue count that is no multiple of 8: output and the
    five gradients within the tolerance of the fp64 result on the same inputs, relative to its largest entry."""
    tensors, grad_out = _inputs(shape, dtype=dtype, mask_value=-1e9)
    tensors, grad_out = [t.cuda() for t in tensors], grad_out.cuda()
    exact = _run(evoformer_attention_reference, [t.double() for t in tensors], "both", grad_out.double())
    fn = lambda *a: DS4Sci_EvoformerAttention(*a, backend=backend, chunk_size=3, query_chunk_size=40)  # noqa: E731
    ours = _run(fn, tensors, "both", grad_out)
    for name, a, b in zip(["out", "dQ", "dK", "dV", "dmask", "dpair"], ours, exact):
        assert a.dtype == dtype and a.is_cuda, name
        error = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert error < CUDA_TOLERANCE[dtype], (name, error)
