"""The training runtime: the engine and the parts it composes (precision, optimizers, LR schedules, data)."""
