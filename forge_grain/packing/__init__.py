"""Planning rows from documents: the compiled kernels, packing plans (whole or chunk by chunk), PackedDataset, and varlen metadata."""


def __getattr__(name: str):  # what the old module forge_grain.packing held (see forge_grain.moved)
    from forge_grain.moved import package_attribute

    return package_attribute(__name__, name)
