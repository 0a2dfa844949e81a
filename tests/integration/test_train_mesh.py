"""The trainer on a (data, fsdp) mesh of 4 forced host devices, in a subprocess (the device
count is fixed when JAX starts): the same step as on one device, parameters sharded."""

from tests.helpers import run_on_devices

SCRIPT = r"""
import json
import jax
import numpy as np
from streamrl.config import TrainerConfig
from streamrl.model.llm import init_params
from streamrl.model.spec import ModelSpec
import optax
from streamrl.trainer.step import (build_batch, init_state, make_train_mesh, TrainStep,
                                   standard_promotion)

assert len(jax.devices()) == 4, jax.devices()
spec = ModelSpec.from_config({
    "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": True})
params = init_params(spec, 0, std=0.1)
rng = np.random.default_rng(0)
items = []
for n in (20, 24, 30, 9, 17, 28):
    t = rng.integers(1, 64, n).astype(np.int32)
    m = (np.arange(n) >= n // 2).astype(np.uint8)
    items.append((t, m, np.where(m > 0, -4.0 + rng.normal(0, 0.1, n), 0.0)))
adv = [1.0, -1.0, 0.5, 2.0, -0.5, 0.0]
cfg = TrainerConfig(learning_rate=1e-2, loss="dapo", kl_beta=0.1, micro_batch_size=4)
out = {}
for name, (data, fsdp) in {"plain": (1, 1), "2x2": (2, 2), "1x4": (1, 4), "4x1": (4, 1)}.items():
    mesh = None if name == "plain" else make_train_mesh(data, fsdp)
    # SGD with momentum (optimizer state to shard, and params that compare gradients: Adam's
    # first steps are lr x sign(g), which turns float noise on tiny gradients into steps).
    opt = standard_promotion(optax.sgd(0.1, momentum=0.9))
    step = TrainStep(spec, cfg, 1.0, opt, mesh)
    state = init_state(params, opt, with_reference=True, mesh=mesh)
    batch = build_batch(items, adv, 0, step.row_multiple)
    for _ in range(2):
        state, metrics = step(state, batch)
    leaves = jax.tree.leaves(state.params)
    out[name] = {"params": [np.asarray(x).ravel()[:64].tolist() for x in leaves],
                 "loss": float(metrics["loss"]), "rows": int(batch.tokens.shape[0]),
                 "compiles": step.compile_count}
    up = state.params["model"]["layers_0"]["mlp"]["up_proj"]["kernel"]
    mu = jax.tree.leaves(state.opt_state)
    out[name]["opt_sharded"] = any("fsdp" in str(x.sharding.spec) for x in mu
                                   if hasattr(x.sharding, "spec"))
    out[name]["spec"] = str(up.sharding.spec) if mesh is not None else ""
try:
    make_train_mesh(4, 2)
except ValueError as err:
    out["error"] = str(err)
print(json.dumps(out))
"""


def test_trainer_on_a_mesh_matches_one_device() -> None:
    out = run_on_devices(SCRIPT, 4)
    plain = out["plain"]
    for mesh in ("2x2", "1x4", "4x1"):
        assert abs(out[mesh]["loss"] - plain["loss"]) < 1e-5, mesh
        for a, b in zip(out[mesh]["params"], plain["params"], strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, mesh
        assert out[mesh]["compiles"] == 1
    # Rows pad to a multiple of the micro-batch and of the mesh's batch devices.
    assert plain["rows"] == 8 and out["2x2"]["rows"] == 8
    # fsdp shards the largest divisible axis (up_proj [32, 64]: the 64 outputs).
    assert (
        out["1x4"]["spec"] == "PartitionSpec(None, 'fsdp')"
        or out["1x4"]["spec"] == "P(None, 'fsdp')"
    )
    assert out["4x1"]["spec"] in ("P()", "PartitionSpec()")  # fsdp 1: replicated
    assert out["1x4"]["opt_sharded"] and not out["4x1"]["opt_sharded"]  # momentum like params
    assert out["error"] == "trainer mesh data=4 x fsdp=2 needs 8 devices; 4 available"
