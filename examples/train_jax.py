"""Train a tiny GPT in JAX (optax) on the demo corpus, checkpoint model, optimizer and data
iterator together with Orbax, get killed, resume, and check the loss curve matches.

    python examples/train_jax.py [--steps 200] [--checkpoint-at 100]

Data: forge-grain's pipeline through `forge_grain.bridges.jax.JaxIterator` (global jax.Arrays, device
prefetch); its state goes into the same Orbax checkpoint as the parameters
(`forge_grain.pipeline.checkpoint.Save`). Document masking: `jax.nn.dot_product_attention` with
the batch's segment-id mask (`forge_grain.bridges.jax.document_mask`: query i sees key j iff
`segment_ids` match and j <= i; on TPU, `splash_segment_ids` gives splash attention the
same), position embeddings use `positions`, and the loss is averaged over `loss_mask`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from forge_grain.bridges.jax import JaxIterator, document_mask
from common import demo_config, example_main
from forge_grain import Pipeline, checkpoint

D, LAYERS, HEADS = 64, 2, 4


def init(key, vocab, seq_len):
    keys = iter(jax.random.split(key, 4 + 4 * LAYERS))
    normal = lambda shape, scale=0.02: scale * jax.random.normal(next(keys), shape)  # noqa: E731
    layers = [
        {"qkv": normal((D, 3 * D)), "proj": normal((D, D)), "up": normal((D, 4 * D)), "down": normal((4 * D, D)),
         "ln1": jnp.ones(D), "ln2": jnp.ones(D)}
        for _ in range(LAYERS)
    ]
    return {"tok": normal((vocab, D)), "pos": normal((seq_len, D)), "layers": layers, "ln": jnp.ones(D),
            "head": normal((D, vocab))}


def norm(x, g):
    return g * (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def forward(params, inputs, positions, segment_ids):
    B, T = inputs.shape
    mask = document_mask(segment_ids)  # [B, 1, T, T]; padding (segment 0) attends to padding only
    x = params["tok"][inputs] + params["pos"][positions]
    for p in params["layers"]:
        q, k, v = jnp.split(norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
        heads = lambda t: t.reshape(B, T, HEADS, D // HEADS)  # noqa: E731  [B, T, N, H]
        attn = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), mask=mask)
        x = x + attn.reshape(B, T, D) @ p["proj"]
        x = x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"]) @ p["down"]
    return norm(x, params["ln"]) @ params["head"]


def loss_fn(params, batch):
    logits = forward(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return (per_token * mask).sum() / jnp.maximum(mask.sum(), 1)


def train(args, resume: bool) -> dict:
    cfg = demo_config(args.workdir)
    pipeline = Pipeline(cfg, 0, 1)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    data = JaxIterator(pipeline, sharding, prefetch=2)
    params = init(jax.random.PRNGKey(0), pipeline.stores[0].vocab_size, cfg.seq_len)
    opt = optax.adamw(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step_fn(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mngr = ocp.CheckpointManager((args.workdir / "checkpoints").resolve())
    start = 0
    if resume:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.Composite(
            train=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}), data=checkpoint.Restore(data)))
        params, opt_state = restored["train"]["params"], restored["train"]["opt_state"]
    losses = {}
    for step in range(start, args.steps):
        batch = next(data)
        assert batch["step"] == step
        params, opt_state, loss = step_fn(params, opt_state, {k: v for k, v in batch.items() if k != "step"})
        losses[step] = float(loss)
        if args.phase == "until-kill" and step + 1 == args.checkpoint_at:
            mngr.save(step + 1, args=ocp.args.Composite(
                train=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), data=checkpoint.Save(data)))
            mngr.wait_until_finished()  # Orbax writes to a temporary directory and renames it when complete
            print(f"checkpoint at step {step + 1}; killing the process", flush=True)
            os._exit(137)
        if step % 25 == 0:
            print(f"[{args.phase}] step {step:4d}  loss {float(loss):.4f}", flush=True)
    data.close()
    return losses


if __name__ == "__main__":
    example_main(__doc__, __file__, train, "forge-grain-demo/jax-example")
