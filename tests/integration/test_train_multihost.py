"""The train step across two processes with `jax.distributed` (gloo collectives on the CPU),
two host devices each, one (data, fsdp) = (2, 2) mesh over all four: the same loss and
update as one process on one device."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from streamrl.run.redis_server import free_port
from tests.helpers import REPO, devices_env

SCRIPT = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
import optax
from streamrl.config import TrainerConfig
from streamrl.model.llm import init_params
from streamrl.model.spec import ModelSpec
from streamrl.trainer.step import (build_batch, init_state, make_train_mesh, TrainStep,
                                   standard_promotion)

assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
spec = ModelSpec.from_config({
    "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": True})
params = init_params(spec, 0, std=0.1)
rng = np.random.default_rng(0)  # the same batch in both processes
items = []
for n in (20, 24, 30, 9, 17, 28, 12, 31):
    t = rng.integers(1, 64, n).astype(np.int32)
    m = (np.arange(n) >= n // 2).astype(np.uint8)
    items.append((t, m, np.where(m > 0, -4.0 + rng.normal(0, 0.1, n), 0.0)))
adv = [1.0, -1.0, 0.5, 2.0, -0.5, 0.0, 1.5, -2.0]
cfg = TrainerConfig(loss="dapo", micro_batch_size=4)
out = {}
for name, mesh in (("local", None), ("global", make_train_mesh(2, 2))):
    opt = standard_promotion(optax.sgd(0.1, momentum=0.9))
    step = TrainStep(spec, cfg, 1.0, opt, mesh)
    if mesh is None:  # one process, one device: the reference
        with jax.default_device(jax.local_devices()[0]):
            state = init_state(params, opt)
            batch = build_batch(items, adv, 0, step.row_multiple)
            for _ in range(2):
                state, metrics = step(state, batch)
    else:
        state = init_state(params, opt, mesh=mesh)
        batch = build_batch(items, adv, 0, step.row_multiple)
        for _ in range(2):
            state, metrics = step(state, batch)
    loss = metrics["loss"]
    loss = float(loss.addressable_data(0)) if hasattr(loss, "addressable_data") else float(loss)
    # Each process checks the parameter shards it holds against the same rows of the reference.
    kernel = state.params["model"]["layers_0"]["mlp"]["up_proj"]["kernel"]
    out[name] = {"loss": loss, "shards": [
        {"index": [[s.start or 0, s.stop] for s in sh.index], "data": np.asarray(sh.data).tolist()}
        for sh in kernel.addressable_shards]}
    if mesh is None:
        out["full"] = np.asarray(kernel).tolist()
print(json.dumps(out))
"""


def test_train_step_across_two_processes_matches_one(tmp_path: Path) -> None:
    port = free_port()
    env = devices_env(2)
    # Output to files, not pipes: a process blocked on a full pipe would stall the other
    # inside a collective.
    procs = []
    for i in range(2):
        with open(tmp_path / f"{i}.out", "w") as out, open(tmp_path / f"{i}.err", "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SCRIPT, str(i), str(port)],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=err,
                )
            )
    outs = []
    try:
        for i, p in enumerate(procs):
            code = p.wait(timeout=200)
            assert code == 0, (tmp_path / f"{i}.err").read_text()[-3000:]
            lines = (tmp_path / f"{i}.out").read_text().splitlines()
            outs.append(json.loads(next(ln for ln in reversed(lines) if ln.startswith("{"))))
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    for out in outs:
        assert abs(out["global"]["loss"] - out["local"]["loss"]) < 1e-5
        full = np.asarray(out["full"])
        for shard in out["global"]["shards"]:
            rows, cols = (slice(a, b) for a, b in shard["index"])
            np.testing.assert_allclose(np.asarray(shard["data"]), full[rows, cols], atol=1e-5)
    # The fsdp axis splits the kernel: each process holds only part of it.
    sizes = {np.asarray(s["data"]).size for s in outs[0]["global"]["shards"]}
    assert sizes == {32 * 64 // 2}
