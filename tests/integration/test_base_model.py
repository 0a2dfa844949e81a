"""A base model (a checkpoint whose tokenizer has no chat template) through `streamrl
generate`, against transformers' greedy decoding."""

import json
import shutil
from pathlib import Path

import pytest

from streamrl.chat.tiny_tokenizer import CHAT_TEMPLATE, EOS
from streamrl.config import parse_config
from streamrl.model.tiny import ensure_checkpoint
from tests.helpers import run_generate

PROMPT = "Compute 12+30 with the calculator."


def make_base_checkpoint(out: Path, cache: Path) -> Path:
    """The built-in tiny checkpoint (random weights) made a base model, as Qwen2.5 base
    ships: no chat template, and eos is the end of text, not the end of a chat turn."""
    tiny = ensure_checkpoint(parse_config({"model": {"cache_dir": str(cache)}}))
    shutil.copytree(tiny, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    config["eos_token"] = EOS
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    generation = json.loads((out / "generation_config.json").read_text())
    generation["eos_token_id"] = generation["eos_token_id"][1]  # [<|im_end|>, EOS] -> EOS
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("base")
    return make_base_checkpoint(root / "ckpt", root / "cache")


def test_base_checkpoint_has_no_template(base: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    assert tok.chat_template is None and tok.eos_token == EOS


def test_raw_greedy_matches_transformers(base: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = run_generate("--checkpoint", str(base), "--prompt", PROMPT, "--max-new-tokens", "16",
                 "--greedy", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    assert out["prompt_ids"] == tok.encode(PROMPT, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([out["prompt_ids"]]), do_sample=False, max_new_tokens=16)
    ref_ids = ref[0, len(out["prompt_ids"]) :].tolist()
    assert len(out["token_ids"]) == len(ref_ids) and out["token_ids"] == ref_ids
    assert out["text"] == tok.decode(ref_ids)


def test_chat_needs_a_template(base: Path) -> None:
    r = run_generate("--checkpoint", str(base), "--prompt", PROMPT, "--chat", "--json")
    assert r.returncode == 2
    assert "has no chat template" in r.stderr and "set --chat-template" in r.stderr
    r = run_generate("--checkpoint", str(base), "--prompt", PROMPT, "--chat", "--chat-template",
                 str(base / "none.jinja"))  # fmt: skip
    assert r.returncode == 2 and "--chat-template = " in r.stderr and "no such file" in r.stderr


def test_chat_with_the_builtin_template(base: Path) -> None:
    from transformers import AutoTokenizer

    r = run_generate("--checkpoint", str(base), "--prompt", PROMPT, "--chat", "--chat-template",
                 "chatml", "--max-new-tokens", "4", "--greedy", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    messages = [{"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert text == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_ids"] == tok.encode(text, add_special_tokens=False)
