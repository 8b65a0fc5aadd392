"""Planning rows from documents: the compiled kernels, packing plans (whole or chunk by chunk), PackedDataset, and varlen metadata."""
