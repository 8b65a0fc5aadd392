"""Write documents with LitData's own writer: `optimize(..., item_loader=TokensLoader())`.

Usage: write_litdata.py DOCS.npz OUT_DIR CHUNK_SIZE DTYPE (DTYPE: the tensor dtype, e.g. int64)
DOCS.npz holds arrays doc_0 ... doc_{n-1}. LitData starts spawn workers, so this runs as a script.
"""

import sys

import numpy as np
import torch
from litdata import TokensLoader, optimize

DOCS = None


def tokens(i):
    yield torch.from_numpy(DOCS[f"doc_{i}"].astype(sys.argv[4]))


if __name__ == "__main__":
    DOCS = np.load(sys.argv[1])
    n = len(DOCS.files)
    optimize(fn=tokens, inputs=list(range(n)), output_dir=sys.argv[2], chunk_size=int(sys.argv[3]),
             item_loader=TokensLoader(), num_workers=1, mode="overwrite")
else:
    DOCS = np.load(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].endswith(".npz") else None
