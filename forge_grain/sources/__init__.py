"""One factory from a SourceConfig to rows: stored sources (deferred or opened), eager and streaming Hugging Face sources, text streams."""


def __getattr__(name: str):  # what the old module forge_grain.sources held (see forge_grain.moved)
    from forge_grain.moved import package_attribute

    return package_attribute(__name__, name)
