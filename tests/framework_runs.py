"""Shared by the tests that run trainers' own loops (OLMo-core, torchtitan) under torchrun: a
small two-store config, and the per-rank step records their scripts write."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import store


def two_store_toml(base: Path, docs: tuple[int, int], seeds: tuple[int, int], seed: int,
                   weights: tuple[float, float]) -> Path:
    """`web` (bos_bestfit) and `code` stores, 2 epochs of 8 rows x 64 tokens a step."""
    web, code = store(base / "web", docs[0], seeds[0]), store(base / "code", docs[1], seeds[1])
    toml = base / "data.toml"
    toml.write_text(f"""seq_len = 64\nglobal_batch_size = 8\nseed = {seed}\nnum_epochs = 2\n
[[sources]]\nname = "web"\npath = "{web}"\nweight = {weights[0]}\nstrategy = "bos_bestfit"\n
[[sources]]\nname = "code"\npath = "{code}"\nweight = {weights[1]}\n""")
    return toml


def step_records(record: Path, ranks: int) -> dict:
    """{(step, rank): batch hash} from RECORD + rank + ".jsonl", each step once per rank."""
    out = {}
    for r in range(ranks):
        for line in Path(f"{record}{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert (rec["step"], r) not in out, f"step {rec['step']} seen twice on rank {r}"
            out[(rec["step"], r)] = rec["hash"]
    return out
