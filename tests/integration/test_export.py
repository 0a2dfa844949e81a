"""The trainer's loop trains a few steps on real groups from Redis, then `ExportHook`
writes a Hugging Face checkpoint that transformers loads as the trained policy."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import redis
import structlog
import torch
import transformers
from structlog.testing import capture_logs

from streamrl.chat.hf import HFChat
from streamrl.config import parse_config
from streamrl.evaluation import watch as evalrun
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.llm import Params, causal_logits
from streamrl.model.spec import ModelSpec
from streamrl.model.tiny import ensure_checkpoint
from streamrl.names import Keys
from streamrl.tools.registry import CALCULATOR
from streamrl.trainer.hooks import EvalSnapshotHook, ExportHook
from streamrl.trainer.loop import TrainerLoop
from streamrl.trainer.step import (
    TrainStep,
    build_batch,
    init_state,
    make_optimizer,
    token_logprobs,
)
from streamrl.transport import publish
from streamrl.wire import Group, Trajectory, pack_arrays

STEPS = 3
TINY = {"d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "d_ff": 64}


def _group(i: int, chat: HFChat, spec: ModelSpec, params: Params) -> tuple[Group, list[list[int]]]:
    """Two members answering one prompt, on-policy log-probs, advantages +1 and -1."""
    prompt = chat.dialogue([CALCULATOR.schema()]).prompt(
        f"Compute {i}+{i + 3} with the calculator."
    )
    turns = [chat.assistant_turn(f"<answer>{i + k}</answer>") for k in (3, 4)]
    seqs = [prompt + t for t in turns]
    masks = [[0] * len(prompt) + [1] * len(t) for t in turns]
    probe = build_batch(
        [
            (np.asarray(s), np.asarray(m), np.zeros(len(s)))
            for s, m in zip(seqs, masks, strict=True)
        ],
        [0, 0],
        0,
    )
    logp = np.asarray(token_logprobs(params, spec, probe.tokens, 1.0))
    members = [
        Trajectory(
            traj_id=f"g{i}-{k}",
            group_id=f"g{i}",
            task_id=f"t{i}",
            member=k,
            num_generations=2,
            **pack_arrays(s, m, np.where(np.array(m) > 0, logp[k, : len(s)], 0.0)),
            prompt_len=len(prompt),
            reward=1.0 - k,
            status="ok",
            versions=[0],
        )
        for k, (s, m) in enumerate(zip(seqs, masks, strict=True))
    ]
    group = Group(group_id=f"g{i}", task_id=f"t{i}", members=members, advantages=[1.0, -1.0])
    return group, seqs


def test_export_loads_in_transformers_as_the_trained_policy(
    tmp_path: Path, rclient: redis.Redis, keys: Keys
) -> None:
    cfg = parse_config(
        {
            "model": {**TINY, "cache_dir": str(tmp_path / "cache")},
            "trainer": {"groups_per_step": 1, "learning_rate": 3e-2},
            "transport": {"block_ms": 50},
        }
    )
    ckpt = ensure_checkpoint(cfg)
    chat = HFChat.from_dir(ckpt)
    spec, params = load_checkpoint(ckpt)
    sequences = []
    for i in range(STEPS):
        group, seqs = _group(i, chat, spec, params)
        publish(rclient, keys.groups, group)
        sequences += seqs
    optimizer = make_optimizer(cfg.trainer)
    export, final = tmp_path / "run" / "export", tmp_path / "run" / "final"
    loop = TrainerLoop(
        client=rclient,
        keys=keys,
        cfg=cfg,
        state=init_state(params, optimizer),
        train_step=TrainStep(spec, cfg.trainer, 1.0, optimizer),
        log=structlog.get_logger(),
        stop=lambda: False,
        pad_id=chat.pad_id,
        max_steps=STEPS,
        hooks=[
            ExportHook(2, export, spec, ckpt),
            ExportHook(0, final, spec, ckpt),
            EvalSnapshotHook(2, evalrun.eval_dir(tmp_path / "run"), spec, ckpt),
        ],
    )
    with capture_logs() as logs:
        loop.run()
    # Every 2 steps and once more for the last (odd) step; `every` 0: at the end only.
    written = [(e["step"], Path(e["path"]).name) for e in logs if e["event"] == "export_written"]
    assert written == [(2, "export"), (3, "export"), (3, "final")]
    assert sorted(p.name for p in export.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in export.parent.iterdir()) == ["eval", "export", "final"]
    # The evaluator's snapshots (trainer.eval_every): the policy before any step, every 2
    # steps and the last; each one drops the older pending ones (the evaluator takes the
    # newest), and carries the time it was written.
    snaps = [(e["step"], e["pruned"]) for e in logs if e["event"] == "eval_snapshot_written"]
    assert snaps == [(0, []), (2, [0]), (3, [2])]
    root = evalrun.eval_dir(tmp_path / "run")
    [(step, snapshot)] = evalrun.pending(root)
    assert step == 3 and evalrun.snapshot_written_at(snapshot) is not None
    assert not (export / evalrun.SNAPSHOT_WRITTEN).exists()
    # The groups carry the starting policy's log-probs: the first step trains on policy,
    # the later ones off it, and each train_step line says how far (mismatch metrics).
    steps = [e for e in logs if e["event"] == "train_step"]
    assert steps[0]["mismatch_logp_abs"] < 1e-4 < steps[-1]["mismatch_logp_abs"]
    assert steps[-1]["mismatch_kl"] > 0 and steps[-1]["correction_fraction"] == 0

    trained = loop.state.params
    tokens = np.array([s[:96] for s in sequences[:2]], np.int32)
    ours = np.asarray(causal_logits(trained, spec, tokens))
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    before = np.asarray(causal_logits(params, spec, tokens))
    assert np.abs(ours - before).max() > 1e-2  # the export holds the trained weights

    # The tokenizer and chat template travel with it: the same ids, the same episodes.
    tok = transformers.AutoTokenizer.from_pretrained(export)
    text = chat.decode(sequences[0])
    assert tok.encode(text, add_special_tokens=False) == sequences[0]
    exported = HFChat.from_dir(export)
    assert exported.stop_ids == chat.stop_ids
    prompt = exported.dialogue([CALCULATOR.schema()]).prompt("Compute 0+3 with the calculator.")
    assert prompt == sequences[0][: len(prompt)]
    assert sequences[0][len(prompt) :] == chat.assistant_turn("<answer>3</answer>")
    for out in (export, snapshot):
        spec_back, params_back = load_checkpoint(out)
        assert spec_back == spec
        same = zip(jax.tree.leaves(params_back), jax.tree.leaves(trained), strict=True)
        assert all(np.array_equal(a, b) for a, b in same)
