"""Run by the tests in a fresh process: save a pipeline checkpoint with Orbax, or restore one
on some number of shards and write the global batches that follow (shards concatenated)."""

import sys

import numpy as np
import orbax.checkpoint as ocp

from forge_grain import DataConfig, Pipeline, checkpoint


def main(mode, config_path, ckpt_dir, shards, steps, workers, out=None):
    cfg = DataConfig.from_toml(config_path)
    shards, steps, workers = int(shards), int(steps), int(workers)
    iters = [iter(Pipeline(cfg, k, shards, worker_count=workers)) for k in range(shards)]
    mngr = ocp.CheckpointManager(ckpt_dir)
    if mode == "save":  # train `steps` steps on every shard, then checkpoint once
        for _ in range(steps):
            for it in iters:
                next(it)
        checkpoint.save(mngr, steps, iters[0])
        mngr.wait_until_finished()
        return
    for it in iters:
        checkpoint.restore(mngr, it)
    batches = []
    for _ in range(steps):
        parts = [next(it) for it in iters]
        batches.append({k: np.concatenate([p[k] for p in parts]) for k in ("inputs", "targets", "loss_mask", "source_id")})
        assert len({int(p["step"]) for p in parts}) == 1
    np.savez(out, **{f"{k}_{i}": v for i, b in enumerate(batches) for k, v in b.items()})
    for it in iters:
        it.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
