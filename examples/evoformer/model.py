"""An Evoformer stack (AlphaFold 2 / OpenFold layout) whose attentions run on `DS4Sci_EvoformerAttention`.

One block updates the MSA representation m [batch, n_seq, n_res, c_m] and the pair representation
z [batch, n_res, n_res, c_z], in OpenFold's order:

    m += MSA row attention with pair bias (z)     m += MSA column attention     m += MSA transition
    z += outer-product mean (m)
    z += triangle multiplication, outgoing edges   z += triangle multiplication, incoming edges
    z += triangle attention around the starting node   z += triangle attention around the ending node
    z += pair transition

Every attention is [batch, rows, cols, heads, dim] attention over `cols` with a residue mask bias
[batch, rows, 1, 1, cols] and, for the row and triangle attentions, a pair bias [batch, 1, heads, cols, cols]:
exactly DS4Sci_EvoformerAttention's contract, so `attention="evoformer"` calls it and `attention="plain"`
calls the plain reference (whole logits), for comparison. Dropout is left out (a short demo run).

The task (`SyntheticMSA`) needs both tracks: a random "protein" of 20 residue types with mutated copies as
its MSA; the loss is AlphaFold's masked-MSA loss (recover 15% of tokens replaced by a mask token: column
attention sees the other rows) plus a pair head that tells whether residues i and j fall in the same one of
four residue classes (learnable only through the outer-product mean and the pair stack).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from shardspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention
from shardspeed.ops.deepspeed4science.reference import evoformer_attention_reference

RESIDUE_TYPES, MASK_TOKEN, PAD_TOKEN = 20, 20, 21
ATTENTIONS = {"evoformer": DS4Sci_EvoformerAttention, "plain": evoformer_attention_reference}


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[batch, rows, cols] of 1/0 -> the additive bias [batch, rows, 1, 1, cols]: 0 where kept, -inf-like
    where masked (1e9 as OpenFold; 1e4 in fp16, whose largest number is 65504)."""
    big = 1e4 if dtype == torch.float16 else 1e9
    return ((mask.to(dtype) - 1) * big)[:, :, None, None, :]


class GatedAttention(nn.Module):
    """Multi-head attention over dimension 2 of [batch, rows, cols, c] with a sigmoid-gated output."""

    def __init__(self, c_in: int, c_hidden: int, heads: int, attention: str):
        super().__init__()
        self.heads, self.c_hidden, self.attention = heads, c_hidden, ATTENTIONS[attention]
        self.linear_q, self.linear_k, self.linear_v = (
            nn.Linear(c_in, heads * c_hidden, bias=False) for _ in range(3)
        )
        self.linear_g = nn.Linear(c_in, heads * c_hidden)
        self.linear_o = nn.Linear(heads * c_hidden, c_in)
        nn.init.zeros_(self.linear_g.weight)  # OpenFold's gating init: gates start open (sigmoid(1))
        nn.init.ones_(self.linear_g.bias)

    def forward(self, x: torch.Tensor, biases: list) -> torch.Tensor:
        split = x.shape[:-1] + (self.heads, self.c_hidden)  # [batch, rows, cols, heads, c_hidden]
        q, k, v = (linear(x).view(split) for linear in (self.linear_q, self.linear_k, self.linear_v))
        out = self.attention(q, k, v, biases) * torch.sigmoid(self.linear_g(x)).view(split)
        return self.linear_o(out.flatten(-2))


class MSARowAttentionWithPairBias(nn.Module):
    def __init__(self, c_m: int, c_z: int, c_hidden: int, heads: int, attention: str):
        super().__init__()
        self.norm_m, self.norm_z = nn.LayerNorm(c_m), nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, heads, bias=False)
        self.attn = GatedAttention(c_m, c_hidden, heads, attention)

    def forward(self, m, z, msa_mask):
        pair_bias = self.linear_z(self.norm_z(z)).permute(0, 3, 1, 2).unsqueeze(1)  # [batch, 1, H, R, R]
        return self.attn(self.norm_m(m), [mask_bias(msa_mask, m.dtype), pair_bias])


class MSAColumnAttention(nn.Module):
    def __init__(self, c_m: int, c_hidden: int, heads: int, attention: str):
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.attn = GatedAttention(c_m, c_hidden, heads, attention)

    def forward(self, m, msa_mask):
        columns, column_mask = m.transpose(1, 2), msa_mask.transpose(1, 2)  # attend over the sequences
        return self.attn(self.norm(columns), [mask_bias(column_mask, m.dtype)]).transpose(1, 2)


class Transition(nn.Module):
    def __init__(self, c: int, n: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, n * c), nn.ReLU(), nn.Linear(n * c, c))

    def forward(self, x, mask):
        return self.net(x) * mask.unsqueeze(-1).to(x.dtype)


class OuterProductMean(nn.Module):
    """z_ij += Linear(mean over sequences of a_si (x) b_sj), the MSA -> pair communication."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3):
        super().__init__()
        self.norm, self.eps = nn.LayerNorm(c_m), eps
        self.linear_a, self.linear_b = nn.Linear(c_m, c_hidden), nn.Linear(c_m, c_hidden)
        self.linear_out = nn.Linear(c_hidden * c_hidden, c_z)

    def forward(self, m, msa_mask):
        mask = msa_mask.to(m.dtype).unsqueeze(-1)
        m = self.norm(m)
        a, b = self.linear_a(m) * mask, self.linear_b(m) * mask
        outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)
        count = torch.einsum("bsi,bsj->bij", mask[..., 0], mask[..., 0]).unsqueeze(-1)
        return self.linear_out(outer) / (self.eps + count)


class TriangleMultiplication(nn.Module):
    """z_ij += g_ij * Linear(LN(sum_k a_ik b_jk)) (outgoing edges) or sum_k a_ki b_kj (incoming)."""

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool):
        super().__init__()
        self.equation = "bikc,bjkc->bijc" if outgoing else "bkic,bkjc->bijc"
        self.norm_in, self.norm_out = nn.LayerNorm(c_z), nn.LayerNorm(c_hidden)
        self.a_proj, self.a_gate = nn.Linear(c_z, c_hidden), nn.Linear(c_z, c_hidden)
        self.b_proj, self.b_gate = nn.Linear(c_z, c_hidden), nn.Linear(c_z, c_hidden)
        self.linear_z, self.linear_g = nn.Linear(c_hidden, c_z), nn.Linear(c_z, c_z)

    def forward(self, z, pair_mask):
        mask = pair_mask.to(z.dtype).unsqueeze(-1)
        z = self.norm_in(z)
        a = mask * torch.sigmoid(self.a_gate(z)) * self.a_proj(z)
        b = mask * torch.sigmoid(self.b_gate(z)) * self.b_proj(z)
        update = self.linear_z(self.norm_out(torch.einsum(self.equation, a, b)))
        return torch.sigmoid(self.linear_g(z)) * update


class TriangleAttention(nn.Module):
    """Row i of z attends over its edges (i, k) with bias b_jk from z (starting node); the ending-node form
    is the same on z transposed."""

    def __init__(self, c_z: int, c_hidden: int, heads: int, starting: bool, attention: str):
        super().__init__()
        self.starting = starting
        self.norm = nn.LayerNorm(c_z)
        self.linear_tri = nn.Linear(c_z, heads, bias=False)
        self.attn = GatedAttention(c_z, c_hidden, heads, attention)

    def forward(self, z, pair_mask):
        if not self.starting:
            z, pair_mask = z.transpose(1, 2), pair_mask.transpose(1, 2)
        z = self.norm(z)
        triangle_bias = self.linear_tri(z).permute(0, 3, 1, 2).unsqueeze(1)  # [batch, 1, H, R, R]
        out = self.attn(z, [mask_bias(pair_mask, z.dtype), triangle_bias])
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    def __init__(self, c_m=32, c_z=16, c_hidden=8, heads_msa=4, heads_pair=2, attention="evoformer"):
        super().__init__()
        self.msa_row = MSARowAttentionWithPairBias(c_m, c_z, c_hidden, heads_msa, attention)
        self.msa_col = MSAColumnAttention(c_m, c_hidden, heads_msa, attention)
        self.msa_transition = Transition(c_m)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden)
        self.tri_mul_out = TriangleMultiplication(c_z, c_hidden, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(c_z, c_hidden, outgoing=False)
        self.tri_att_start = TriangleAttention(c_z, c_hidden, heads_pair, starting=True, attention=attention)
        self.tri_att_end = TriangleAttention(c_z, c_hidden, heads_pair, starting=False, attention=attention)
        self.pair_transition = Transition(c_z)

    def forward(self, m, z, msa_mask, pair_mask):
        m = m + self.msa_row(m, z, msa_mask)
        m = m + self.msa_col(m, msa_mask)
        m = m + self.msa_transition(m, msa_mask)
        z = z + self.outer_product_mean(m, msa_mask)
        z = z + self.tri_mul_out(z, pair_mask)
        z = z + self.tri_mul_in(z, pair_mask)
        z = z + self.tri_att_start(z, pair_mask)
        z = z + self.tri_att_end(z, pair_mask)
        z = z + self.pair_transition(z, pair_mask)
        return m, z


class Evoformer(nn.Module):
    """Embeddings, `blocks` Evoformer blocks (each optionally checkpointed by `checkpoint_fn`), two heads."""

    def __init__(self, blocks=2, c_m=32, c_z=16, max_relpos=32, attention="evoformer", **block_kwargs):
        super().__init__()
        self.max_relpos = max_relpos
        self.msa_embed = nn.Embedding(PAD_TOKEN + 1, c_m)
        self.left, self.right = nn.Linear(c_m, c_z), nn.Linear(c_m, c_z)
        self.relpos = nn.Embedding(2 * max_relpos + 1, c_z)
        self.blocks = nn.ModuleList(
            EvoformerBlock(c_m, c_z, attention=attention, **block_kwargs) for _ in range(blocks)
        )
        self.msa_head = nn.Linear(c_m, RESIDUE_TYPES)
        self.pair_head = nn.Linear(c_z, 2)
        self.checkpoint_fn = None  # e.g. deepspeed.checkpointing.checkpoint

    def embed(self, msa):
        m = self.msa_embed(msa)
        query = m[:, 0]  # the first row is the target sequence, as in AlphaFold
        offsets = torch.arange(msa.shape[-1], device=msa.device)
        relative = (offsets[:, None] - offsets[None, :]).clamp(-self.max_relpos, self.max_relpos)
        z = (
            self.left(query)[:, :, None]
            + self.right(query)[:, None, :]
            + self.relpos(relative + self.max_relpos)
        )
        return m, z

    def forward(self, batch: dict) -> torch.Tensor:
        residue_mask = batch["residue_mask"]
        msa_mask = residue_mask[:, None, :].expand(batch["msa"].shape)
        pair_mask = residue_mask[:, :, None] * residue_mask[:, None, :]
        m, z = self.embed(batch["msa"])
        for block in self.blocks:
            if self.checkpoint_fn is not None:
                m, z = self.checkpoint_fn(block, m, z, msa_mask, pair_mask)
            else:
                m, z = block(m, z, msa_mask, pair_mask)
        msa_logits = self.msa_head(m).float()
        pair_logits = self.pair_head(z + z.transpose(1, 2)).float()  # the target is symmetric
        msa_loss = F.cross_entropy(msa_logits.flatten(0, 2), batch["msa_target"].flatten(), ignore_index=-100)
        pair_loss = F.cross_entropy(
            pair_logits.flatten(0, 2), batch["pair_target"].flatten(), ignore_index=-100
        )
        return msa_loss + pair_loss


class SyntheticMSA(torch.utils.data.Dataset):
    """Sample i: a random protein of 3/4 to all of `n_res` residues (the rest padding), `n_seq` MSA rows
    (row 0 the protein, the others with 15% of residues mutated), 15% of tokens masked for the model to
    recover, and the pair target "residues i and j are of the same class" (type // 5)."""

    def __init__(self, size: int, n_seq: int, n_res: int, seed: int = 0):
        self.size, self.n_seq, self.n_res, self.seed = size, n_seq, n_res, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n_seq, n_res = self.n_seq, self.n_res
        length = int(torch.randint(3 * n_res // 4, n_res + 1, (), generator=g))
        protein = torch.randint(0, RESIDUE_TYPES, (n_res,), generator=g)
        mutated = torch.rand(n_seq, n_res, generator=g) < 0.15
        mutated[0] = False
        msa = torch.where(mutated, torch.randint(0, RESIDUE_TYPES, (n_seq, n_res), generator=g), protein)
        valid = torch.arange(n_res) < length
        masked = (torch.rand(n_seq, n_res, generator=g) < 0.15) & valid
        target = torch.where(masked, msa, torch.full_like(msa, -100))
        msa = torch.where(masked, torch.full_like(msa, MASK_TOKEN), msa)
        msa[:, ~valid] = PAD_TOKEN
        classes = protein // 5
        same = (classes[:, None] == classes[None, :]).long()
        pair_valid = valid[:, None] & valid[None, :]
        return {
            "msa": msa,
            "msa_target": target,
            "residue_mask": valid.float(),
            "pair_target": torch.where(pair_valid, same, torch.full_like(same, -100)),
        }
