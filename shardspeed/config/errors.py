"""The one error type every configuration problem raises."""


class ConfigError(ValueError):
    """A DeepSpeed/shardspeed config is malformed. The message names the key path and the offending value.

    Exported as `shardspeed.DeepSpeedConfigError` too, so `except deepspeed.DeepSpeedConfigError` keeps working.
    """
