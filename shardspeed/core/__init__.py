"""The training parts every feature builds on: the bottom of the training stack.

precision (loss scaling, master weights, casts), grad_buckets (flat gradient buckets and their reduction),
optimizer_wrapper (what the engine steps), placement (where optimizer state lives), memory (per-rank byte
accounting), layout (the rank grid of data/tensor/pipeline/expert/sequence groups), flat_params (flat
parameter buffers), partitioned (the state of a ZeRO-3 partitioned parameter), module_dtypes, autocast and
usage_errors. zero/, moe/, pipe/, sequence/ and checkpoint/ import from here; nothing here imports them or
the engine (tests/test_structure.py checks that).
"""
