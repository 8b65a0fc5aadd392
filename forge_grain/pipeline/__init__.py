"""The pipeline: its config (and the KempnerForge job reader), the mixture and its history, Pipeline, and checkpointing."""
