"""DeepSpeed's `deepspeed.runtime.sequence_parallel` path: the Hugging Face Ulysses adapters (stand-ins so far;
Ulysses itself lives in `shardspeed.sequence`)."""
