"""Regenerate tests/data/litdata: a dataset written by LitData's own writer, and what its reader yields.

    python tests/scripts/make_litdata_fixture.py   (needs `pip install litdata`)

litdata cannot be a test dependency here: it requires torchvision, and PyPI's torchvision is
built against CUDA torch, so with the CPU torch the tests pin, importing it fails and breaks
transformers' model imports. So the dataset is written once with `litdata.optimize(...,
TokensLoader())` and committed with the documents given to it (`docs.npz`) and the blocks
`StreamingDataset(item_loader=TokensLoader(block_size=16))` returns (`blocks16.npy`).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "data" / "litdata"


def main():
    rng = np.random.default_rng(11)
    docs = [rng.integers(2, 1000, rng.integers(1, 200)).astype(np.int64) for _ in range(200)]
    for d in docs:
        d[-1] = 1
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    np.savez_compressed(OUT / "docs.npz", **{f"doc_{i}": d for i, d in enumerate(docs)})
    subprocess.run([sys.executable, HERE / "write_litdata.py", OUT / "docs.npz", OUT / "dataset", "4000", "int64"],
                   check=True)
    from litdata import StreamingDataset, TokensLoader

    ds = StreamingDataset(str(OUT / "dataset"), item_loader=TokensLoader(block_size=16), shuffle=False)
    np.save(OUT / "blocks16.npy", np.stack([ds[i].numpy() for i in range(len(ds))]).astype(np.uint16))  # ids < 1000


if __name__ == "__main__":
    main()
