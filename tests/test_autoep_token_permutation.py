"""Token permutation for grouped expert matmuls (moe/autoep/token_permutation.py, DeepSpeed's moe.ep_kernels):
the padded expert-major order, its inverse, and their gradients, against plain indexing."""

import torch

from shardspeed.moe.autoep.token_permutation import (
    TOKEN_GROUP_ALIGN_SIZE_M,
    generate_permute_indices,
    indices_padding_wrapper,
    permute_rows,
    unpermute_rows,
)


def test_generate_permute_indices_groups_rows_by_expert_with_aligned_padding():
    # 2 ranks x 2 local experts, rank-major counts: rank 0 sends 2 rows to expert 0, none to expert 1; rank 1 sends
    # 1 to expert 0 and 3 to expert 1
    counts = torch.tensor([2, 0, 1, 3])
    indices, sizes, offsets = generate_permute_indices(counts, 2, 2, max_len=16, alignment=4)
    assert sizes.tolist() == [4, 4] and offsets.tolist() == [4, 8]
    assert indices.tolist() == [0, 1, 2, -1, 3, 4, 5, -1] + [-1] * 8
    # an expert without rows still gets one aligned (empty) group
    _, sizes, _ = generate_permute_indices(torch.tensor([0, 5]), 2, 1, max_len=16, alignment=4)
    assert sizes.tolist() == [4, 8]


def test_permute_and_unpermute_match_plain_indexing_with_gradients():
    counts = torch.tensor([2, 0, 1, 3])
    indices, _, _ = generate_permute_indices(counts, 2, 2, max_len=16, alignment=4)
    x = torch.randn(6, 3, requires_grad=True)
    reference = x.detach().clone().requires_grad_(True)
    padded = permute_rows(x, indices)
    expected = torch.cat((reference, reference.new_zeros(1, 3)))[indices.long()]  # -1: the appended zero row
    assert torch.equal(padded, expected)
    weights = torch.randn_like(padded)
    (padded * weights).sum().backward()
    (expected * weights).sum().backward()
    assert torch.equal(x.grad, reference.grad)
    back = unpermute_rows(padded * 2, indices, 6)
    assert torch.equal(back, 2 * x.detach())


def test_indices_padding_wrapper_runs_experts_on_aligned_groups():
    torch.manual_seed(0)
    experts, hidden = 2, 3
    w = torch.randn(experts, hidden, hidden)
    counts = torch.tensor(
        [3, 1, 0, 2]
    )  # rank-major: source-major rows 0-2 expert 0, 3 expert 1, 4-5 expert 1
    x = torch.randn(int(counts.sum()), hidden)
    seen = {}

    def grouped(w1, w2, w3, rows, aligned):
        seen["aligned"] = aligned.tolist()
        out, at = torch.zeros_like(rows), 0
        for e, n in enumerate(aligned.tolist()):
            out[at : at + n] = rows[at : at + n] @ w1[e]
            at += n
        return out

    out = indices_padding_wrapper(grouped)(w, w, w, x, counts)
    expert_of_row = [0, 0, 0, 1, 1, 1]
    expected = torch.stack([x[i] @ w[e] for i, e in enumerate(expert_of_row)])
    torch.testing.assert_close(out, expected)
    assert all(n % TOKEN_GROUP_ALIGN_SIZE_M == 0 for n in seen["aligned"])
