"""The pipeline: its config (and the KempnerForge job reader), the mixture and its history, Pipeline, and checkpointing."""

from forge_grain.pipeline import kempnerforge  # noqa: E402,F401  registers KempnerForge's job files with DataConfig


def __getattr__(name: str):  # what the old module forge_grain.pipeline held (see forge_grain.moved)
    from forge_grain.moved import package_attribute

    return package_attribute(__name__, name)
