"""The bridges: forge-grain's pipeline as PyTorch (`torch`, `torch_varlen`), JAX (`jax`),
OLMo-core (`olmo`), torchtitan (`titan_batches`, `torchtitan`) and KempnerForge
(`kempnerforge`) expect their data. Each imports its framework; the rest of forge-grain
never does. Until 0.2 they also import by their old top-level name (`bridges.torch`),
with a DeprecationWarning (see `forge_grain.moved`)."""
