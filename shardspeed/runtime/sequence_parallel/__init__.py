"""DeepSpeed's `deepspeed.runtime.sequence_parallel` path (Ulysses sequence parallelism): not built yet."""
