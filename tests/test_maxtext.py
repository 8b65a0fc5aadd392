"""forge-grain inside MaxText: the adapter's contract here (forge_grain/bridges/maxtext.py, no
MaxText needed), and MaxText's own training loop (slow: MaxText needs Python >= 3.12, so it
runs in an environment of its own, made once and kept under ~/.cache/forge-grain/envs): its
`train.main` fed by forge-grain's iterator, with MaxText's own Orbax checkpointing, killed one
step after a checkpoint and restarted; every later step is trained once.

The reference for every batch is the forge-grain pipeline itself.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import types
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from conftest import SLOW
from framework_runs import REPO, SCRIPTS, framework_env, two_store_toml

from forge_grain import ConfigError, DataConfig, Pipeline
from forge_grain.bridges.jax import MAXTEXT_KEYS, maxtext
from forge_grain.bridges.maxtext import data_iterators

MAXTEXT = "maxtext==0.2.5"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two small stores; 2 epochs of 8 rows x 64 tokens a step."""
    return two_store_toml(tmp_path_factory.mktemp("maxtext"), (90, 60), (4, 5), seed=7, weights=(0.5, 0.5))


def maxtext_config(**changes):
    """What the adapter reads of MaxText's config (`HyperParameters`), as MaxText sets it for
    one CPU device, per_device_batch_size=8, max_target_length=64."""
    fields = dict(max_target_length=64, global_batch_size_to_load=8, dataset_type="grain", eval_interval=-1,
                  grain_train_files="", data_sharding=[["data", "stage", "fsdp", "fsdp_transpose", "context",
                                                        "context_usp_ulysses", "context_autoregressive", "tensor",
                                                        "tensor_sequence", "expert", "autoregressive"]])
    return types.SimpleNamespace(**{**fields, **changes})


def mesh():
    axes = maxtext_config().data_sharding[0]
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)


def digest(batch) -> str:
    """A batch's hash as the MaxText run records it (what trains: inputs, targets, and where the loss applies)."""
    return hashlib.sha256(b"".join(np.asarray(batch[k]).tobytes() for k in
                                   ("inputs", "targets", "targets_segmentation"))).hexdigest()


def expected(toml) -> list[str]:
    p = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0)
    return [digest(maxtext(p.batch(s))) for s in range(p.num_steps)]


def test_the_adapter_gives_maxtext_the_pipelines_batches_under_its_names(data):
    it, evaluation = data_iterators(data)(maxtext_config(), mesh())
    assert evaluation is None
    assert isinstance(it, grain.DatasetIterator)  # how MaxText's checkpointing saves it (get_state as JSON)
    want = expected(data)
    sharding = jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec(*maxtext_config().data_sharding))
    for s in range(3):
        batch = next(it)
        assert set(batch) == set(MAXTEXT_KEYS) and it.last_step == s
        assert all(v.shape == (8, 64) and v.dtype == np.int32 for v in batch.values())
        jax.device_put(batch, sharding)  # what MaxText's DataLoader does with the whole batch
        assert digest(batch) == want[s]


def test_the_state_maxtext_checkpoints_resumes_at_the_next_step(data):
    """MaxText writes `json.dumps(iterator.get_state())` in its checkpoint's `iter` item and
    calls `set_state(json.loads(...))` on the new run's iterator."""
    create = data_iterators(data)
    it, _ = create(maxtext_config(), mesh())
    for _ in range(5):
        next(it)
    saved = json.dumps(it.get_state())
    later = [digest(next(it)) for _ in range(3)]
    fresh, _ = create(maxtext_config(), mesh())
    fresh.set_state(json.loads(saved))
    assert [digest(next(fresh)) for _ in range(3)] == later == expected(data)[5:8]


@pytest.mark.parametrize("change, message", [
    (dict(max_target_length=128), r"seq_len = 64 but MaxText's max_target_length = 128"),
    (dict(global_batch_size_to_load=16), r"global_batch_size = 8 but MaxText's global batch .* = 16"),
    (dict(dataset_type="hf"), r"dataset_type is 'hf': set dataset_type=grain"),
    (dict(eval_interval=10), r"set eval_interval=-1"),
])
def test_a_maxtext_config_that_disagrees_is_named(data, change, message):
    with pytest.raises(ConfigError, match=message):
        data_iterators(data)(maxtext_config(**change), mesh())


# -- MaxText itself (slow) ------------------------------------------------------------------------


def maxtext_python() -> Path:
    """Python 3.12 with MaxText, the dependencies of its `tpu` extra except libtpu (no TPU
    here: JAX runs on the CPU), and forge-grain's own; made once (`framework_env`)."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python"))) or \
        [p for p in (shutil.which("python3.12"),) if p]
    if not found:
        pytest.skip("MaxText needs Python >= 3.12; none found (~/.pyenv/versions/3.12*, python3.12)")

    def install(pip, timeout):
        subprocess.run([*pip, "--no-deps", MAXTEXT, "packaging"], check=True, timeout=timeout)
        python = pip[0]
        listed = subprocess.run([python, "-c", TPU_REQUIREMENTS], check=True, capture_output=True, text=True)
        project = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())["project"]
        subprocess.run([*pip, *listed.stdout.split("\n")[:-1], *project["dependencies"]], check=True, timeout=timeout)

    return framework_env(f"{MAXTEXT.replace('==', '-')}-py312", install, python=found[-1])


TPU_REQUIREMENTS = """
import importlib.metadata as md
from packaging.requirements import Requirement
for r in md.requires("maxtext"):
    req = Requirement(r)
    if req.marker is not None and req.marker.evaluate({"extra": "tpu"}) and req.name != "libtpu":
        print(str(req).split(";")[0].strip())
"""


def train(python, toml, out, record, steps, crash_at=-1):
    cmd = [str(python), str(SCRIPTS / "maxtext_train.py"), str(toml), str(out), str(record), str(steps), "4",
           str(crash_at)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}  # this checkout's forge-grain
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def records(path: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["hash"]) for r in map(json.loads, path.read_text().splitlines())]


def metrics(out: Path) -> dict:
    """{step: (loss, target tokens)} from MaxText's own metrics file (the last line of a step)."""
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {int(r["step"]): (r["learning/loss"], r["learning/total_weights"]) for r in rows}


@pytest.mark.skipif(not SLOW, reason="makes MaxText's own environment (minutes, once); FORGE_GRAIN_SLOW=1")
def test_maxtext_trains_on_forge_grain_killed_after_a_checkpoint_and_restarted(data, tmp_path):
    python = maxtext_python()
    want, steps = expected(data), 14
    p = Pipeline(DataConfig.from_toml(data), 0, 1, num_threads=0)
    trained = [float(np.count_nonzero(maxtext(p.batch(s))["targets_segmentation"])) for s in range(steps)]
    whole = train(python, data, tmp_path / "whole", tmp_path / "whole.jsonl", steps)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-5000:]
    assert records(tmp_path / "whole.jsonl") == list(enumerate(want[:steps]))
    # MaxText trained on them: its count of target tokens is the pipeline's loss mask
    assert [metrics(tmp_path / "whole")[s][1] for s in range(steps)] == trained
    # checkpoints every 4 steps (0, 4, 8, ...); killed as it takes step 10's batch: step 8's is the last
    first = train(python, data, tmp_path / "job", tmp_path / "first.jsonl", steps, crash_at=10)
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-5000:]
    assert records(tmp_path / "first.jsonl") == list(enumerate(want[:10]))
    again = train(python, data, tmp_path / "job", tmp_path / "again.jsonl", steps)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    assert records(tmp_path / "again.jsonl") == [(s, want[s]) for s in range(9, steps)]  # every later step once
    assert metrics(tmp_path / "job") == metrics(tmp_path / "whole")  # and the same losses, to the bit
