"""DeepSpeed's engine methods of the data-efficiency library and the legacy curriculum (shardspeed/data_pipeline).

Mixed into `ShardspeedEngine`, which holds the library's part as `engine.data_efficiency` (a
`DataEfficiency`); these are DeepSpeed's names over it. The `*_enabled()` getters answer whether the feature
runs: every switch on its path is true (the config refuses a config where they disagree).
"""

from __future__ import annotations

__all__ = ["DataEfficiencyMethods"]


class DataEfficiencyMethods:
    # -- what scripts call ---------------------------------------------------------------------------------

    def set_data_post_process_func(self, post_process_func) -> None:
        """`fn(batch, sampler_state) -> batch` on every batch of the curriculum loader (DeepSpeed: only that
        loader calls it)."""
        if not hasattr(self.training_dataloader, "post_process_func"):
            raise ValueError(
                "set_data_post_process_func: the training loader is not the curriculum loader (enable "
                "data_efficiency.data_sampling.curriculum_learning and pass training_data to initialize)"
            )
        self.training_dataloader.post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict) -> None:
        """`{metric: fn(step) -> difficulty}` for metrics with schedule_type "custom" (the legacy curriculum's
        metric is named "seqlen" here, which DeepSpeed's method does not reach)."""
        sampler = getattr(self.training_dataloader, "data_sampler", None)
        if sampler is not None and hasattr(sampler, "set_custom_curriculum_learning_schedule"):
            sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)
        legacy = self.data_efficiency.legacy_scheduler
        if legacy is not None and "seqlen" in schedule_func_dict:
            legacy.set_custom_get_difficulty(schedule_func_dict["seqlen"])

    def random_ltd_initialize(self) -> None:
        """Attach the random-LTD scheduler to the model's `RandomLayerTokenDrop` layers
        (`convert_to_random_ltd` calls this)."""
        if self.optimizer is not None and self.zero_optimization_stage() in (1, 2) and self._names_changed():
            raise ValueError(
                "convert_to_random_ltd after initialize at ZeRO stage "
                f"{self.zero_optimization_stage()}: the wrapper adds '.random_ltd_layer' to parameter names, and "
                "the ZeRO-1/2 optimizer recorded the old names when it was built, so its checkpoints would not "
                "load. Convert the module before initialize: convert_to_random_ltd(model, LayerClass), then "
                "deepspeed.initialize(model=model, ...) (the engine attaches the random-LTD scheduler itself)"
            )
        self.data_efficiency.initialize_layers(self.module)

    def _names_changed(self) -> bool:
        """Whether the module's parameter names differ from those the optimizer wrapper was built with."""
        return self.data_efficiency.parameter_names != [n for n, _ in self.module.named_parameters()]

    # -- DeepSpeed's getters -------------------------------------------------------------------------------

    @property
    def random_ltd_scheduler(self):
        return self.data_efficiency.random_ltd_scheduler

    @property
    def curriculum_scheduler_legacy(self):
        return self.data_efficiency.legacy_scheduler

    def data_efficiency_enabled(self) -> bool:
        return self._config.data_efficiency.enabled

    def data_efficiency_config(self):
        return self._config.data_efficiency

    def data_sampling_enabled(self) -> bool:
        block = self._config.data_efficiency
        return block.enabled and block.data_sampling.enabled

    def data_sampling_config(self):
        return self._config.data_efficiency.data_sampling

    def curriculum_learning_enabled(self) -> bool:
        return self._config.data_efficiency.curriculum_enabled

    def curriculum_learning_config(self):
        return self._config.data_efficiency.data_sampling.curriculum_learning

    def random_ltd_enabled(self) -> bool:
        return self._config.data_efficiency.random_ltd_enabled

    def random_ltd_config(self):
        return self._config.data_efficiency.data_routing.random_ltd

    def curriculum_enabled_legacy(self) -> bool:
        return self._config.curriculum_learning.enabled

    def curriculum_params_legacy(self):
        return self._config.curriculum_learning
