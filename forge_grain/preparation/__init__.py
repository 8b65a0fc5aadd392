"""Turning text (or token ids) into token stores: local preparation, the Apache Beam runner, eager Hugging Face sources' cached stores."""


def __getattr__(name: str):  # what the old module forge_grain.preparation held (see forge_grain.moved)
    from forge_grain.moved import package_attribute

    return package_attribute(__name__, name)
