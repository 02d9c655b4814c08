"""ZeRO: partitioned optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)."""
