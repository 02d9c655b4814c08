"""DeepSpeed's `deepspeed.runtime.comm` path: coalesced collectives (coalesced_collectives.py)."""
