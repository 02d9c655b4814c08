"""DeepSpeed4Science's ops (`deepspeed.ops.deepspeed4science`): Evoformer attention without a compiled
kernel. `DS4Sci_EvoformerAttention(Q, K, V, biases)` keeps DeepSpeed's signature and runs on CPU and CUDA
in fp32, bf16 and fp16 (evoformer_attn.py)."""

from shardspeed.ops.deepspeed4science.evoformer_attn import DS4Sci_EvoformerAttention, EvoformerFusedAttention

__all__ = ["DS4Sci_EvoformerAttention", "EvoformerFusedAttention"]
