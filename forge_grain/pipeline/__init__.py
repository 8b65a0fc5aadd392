"""The pipeline: its config (and the KempnerForge job reader), the mixture and its history, Pipeline, and checkpointing."""

from forge_grain.pipeline import kempnerforge  # noqa: E402,F401  registers KempnerForge's job files with DataConfig
