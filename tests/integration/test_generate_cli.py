"""`streamrl generate` as a subprocess, against transformers' greedy decoding."""

import json
from pathlib import Path

import pytest

from streamrl.config import parse_config
from streamrl.model.tiny import ensure_checkpoint
from tests.helpers import run_generate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = parse_config({"model": {"cache_dir": str(tmp_path_factory.mktemp("cache"))}})
    return ensure_checkpoint(cfg)


def test_greedy_matches_transformers(ckpt: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = run_generate(
        "--checkpoint",
        str(ckpt),
        "--prompt",
        "Compute 12+30 with the calculator.",
        "--max-new-tokens",
        "16",
        "--greedy",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == len(out["logprobs"]) <= 16
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert out["prompt_ids"] == tok.encode(
        "Compute 12+30 with the calculator.", add_special_tokens=False
    )
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([out["prompt_ids"]]), do_sample=False, max_new_tokens=16)[
            0, len(out["prompt_ids"]) :
        ].tolist()
    assert out["token_ids"] == ref
    assert out["text"] == tok.decode(ref)


def test_bad_checkpoint_is_named(ckpt: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    r = run_generate("--checkpoint", str(broken), "--prompt", "hi", "--json")
    assert r.returncode == 2
    assert "model.layers.1.mlp.up_proj.weight" in r.stderr
    r = run_generate("--checkpoint", str(tmp_path / "nothing"), "--prompt", "hi")
    assert r.returncode == 2 and "does not exist" in r.stderr
