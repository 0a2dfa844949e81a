"""The engine on a device mesh: 4 forced host devices, in a subprocess (the device count is
fixed when JAX starts)."""

from tests.helpers import run_on_devices

SCRIPT = r"""
import json
import jax
import numpy as np
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.sampling import GenRequest, SamplingParams
from streamrl.model.llm import init_params
from streamrl.model.sharding import MeshError, make_mesh
from streamrl.model.spec import ModelSpec

assert len(jax.devices()) == 4, jax.devices()
spec = ModelSpec.from_config({
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128})
params = init_params(spec, 0, std=0.3)
cfg = EngineConfig(num_slots=8, kv_cache_size=96, max_prompt_length=64, max_new_tokens=16,
                   sampling=SamplingParams(0.9, 1.0, 0), stop_ids=(3,), pad_id=0,
                   decode_chunk=4)
rng = np.random.default_rng(0)
reqs = [GenRequest(rng.integers(4, 128, 5 + 7 * i).tolist(), 16, seed=i) for i in range(6)]
reqs += [GenRequest(reqs[0].prompt, 16, seed=99)]  # a group member sharing a prefill
out = {"plain": [(r.tokens, r.logprobs) for r in Engine(spec, params, cfg).generate(reqs)]}
for data, tensor in ((2, 2), (4, 1), (1, 2)):
    engine = Engine(spec, params, cfg, mesh=make_mesh(data, tensor))
    res = engine.generate(reqs)
    out[f"{data}x{tensor}"] = [(r.tokens, r.logprobs) for r in res]
    q = engine.params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    o = engine.params["model"]["layers_0"]["self_attn"]["o_proj"]["kernel"]
    out[f"{data}x{tensor}-specs"] = [str(q.sharding.spec), str(o.sharding.spec),
                                     str(engine.pool.k[0][0].sharding.spec)]
try:
    Engine(spec, params, cfg, mesh=make_mesh(1, 4))
except MeshError as err:
    out["error"] = str(err)
print(json.dumps(out))
"""


def test_engine_on_a_mesh_matches_one_device() -> None:
    out = run_on_devices(SCRIPT, 4)
    plain = out["plain"]
    for mesh in ("2x2", "4x1", "1x2"):
        for (toks, lps), (ref_toks, ref_lps) in zip(out[mesh], plain, strict=True):
            assert toks == ref_toks, mesh
            assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4, mesh
    # tensor parallel: q by output features, o by input features; the pool by slot and head
    assert out["2x2-specs"] == [
        "P(None, 'tensor')",
        "P('tensor', None)",
        "P('data', 'tensor')",
    ]
    assert out["error"] == "num_key_value_heads (2) is not divisible by tensor=4"
