"""Errors that name the file and the problem, so a user can act on them."""


class ForgeGrainError(ValueError):
    """Base class of every error forge-grain raises on bad input."""


class StoreError(ForgeGrainError):
    """A token store on disk is missing, corrupt, or disagrees with its manifest."""


class PrepareError(ForgeGrainError):
    """A text corpus or tokenizer cannot be turned into a token store."""


class StateError(ForgeGrainError):
    """An iterator state that does not belong to this pipeline (or this process)."""


class MissingFilesError(StoreError, FileNotFoundError):
    """No token file where a store was expected (a path that does not exist, or a pattern
    that matches nothing). Also a `FileNotFoundError`, as KempnerForge's loaders raise."""


class ConfigError(ForgeGrainError):
    """A data configuration key is unknown, missing or invalid; the message names it."""


class StepError(ForgeGrainError, IndexError):
    """A step that is not an integer inside the run (also an `IndexError`, as a sequence's
    index out of range is)."""
