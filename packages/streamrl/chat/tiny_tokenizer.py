"""A small byte-level BPE tokenizer with a ChatML tool template, trained here from scratch.

`build_tiny_tokenizer(out_dir)` trains it on a synthetic corpus shaped like the built-in
arithmetic task (prompts, Hermes tool calls, tool responses, answers) and writes a
directory that `AutoTokenizer.from_pretrained(out_dir)` loads: `tokenizer.json`,
`tokenizer_config.json` (with the `chat_template`) and `generation_config.json` (eos ids).
Nothing is downloaded, and the same call writes byte-identical files every time.

The pipeline is Qwen2's: a regex split that isolates every digit (so copying a number is
one token per digit, which a tiny model can learn), then byte-level BPE, so any text
encodes without an unknown token. The chat template follows Qwen2.5's ideas in a shorter
form, since the tiny model's context is a few hundred tokens: tools are listed as compact
JSON lines in the system turn, calls are `<tool_call>{json}</tool_call>`, and tool results
go back in a user turn as `<tool_response>` blocks, consecutive results in one turn.

Imports `tokenizers` only (no transformers), so building is quick.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from streamrl.tools.registry import CALCULATOR

VOCAB_SIZE = 512
CORPUS_EPISODES = 3000
CORPUS_SEED = 0

PAD = "<|pad|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens (special: skipped by `decode(skip_special_tokens=True)`) come first, then
# the markup tokens the policy writes itself; like Qwen's `<tool_call>` those are added
# tokens that are not special, so decoding always keeps them. Each is one id.
CONTROL_TOKENS = (PAD, EOS, IM_START, IM_END)
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
)

# Qwen2's pre-tokenizer split: letters runs, single digits, punctuation runs, whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOOL_INSTRUCTION = 'Call a tool as <tool_call>{"name":NAME,"arguments":ARGS}</tool_call>.'

# ChatML with Hermes tool calls, the structure of Qwen2.5's template made compact. Tool
# schemas may be OpenAI style ({"type": "function", "function": {...}}) or bare; only the
# function object is listed. An assistant message is rendered from `content` verbatim (the
# sampled text, tool calls included) plus any structured `tool_calls`.
CHAT_TEMPLATE = (
    "{%- set has_sys = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_sys -%}{{- messages[0].content + '\\n' -}}{%- endif -%}"
    "{{- 'Tools:' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{- '\\n' + (fn | tojson(separators=(',', ':'))) -}}"
    "{%- endfor -%}"
    "{{- '\\n" + TOOL_INSTRUCTION + "<|im_end|>\\n' -}}"
    "{%- elif has_sys -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>' + message.content + '</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set call = call.function if call.function is defined else call -%}"
    "{%- set args = call.arguments if call.arguments is string"
    " else (call.arguments | tojson(separators=(',', ':'))) -%}"
    "{{- '<tool_call>{\"name\":' + (call.name | tojson) + ',\"arguments\":' + args"
    " + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _episode_text(r: random.Random, system: str) -> str:
    """One episode as the template renders it: prompt, call, result, answer."""
    a, b = r.randint(0, 999), r.randint(0, 999)
    op = r.choice("+-*")
    expr = f"{a}{op}{b}"
    value = a + b if op == "+" else a - b if op == "-" else a * b
    answer = value if r.random() < 0.8 else value + r.choice([-10, -1, 1, 10])
    call = _compact({"name": "calculator", "arguments": {"expression": expr}})
    return (
        f"{system}{IM_START}user\nCompute {expr} with the calculator.{IM_END}\n"
        f"{IM_START}assistant\n<tool_call>{call}</tool_call>{IM_END}\n"
        f"{IM_START}user\n<tool_response>{value}</tool_response>{IM_END}\n"
        f"{IM_START}assistant\n<answer>{answer}</answer>{IM_END}\n{EOS}"
    )


def corpus(num_episodes: int = CORPUS_EPISODES, seed: int = CORPUS_SEED) -> list[str]:
    """The training texts: rendered arithmetic episodes with the calculator tool listed."""
    tool = _compact(CALCULATOR.schema()["function"])
    system = f"{IM_START}system\nTools:\n{tool}\n{TOOL_INSTRUCTION}{IM_END}\n"
    r = random.Random(seed)
    texts = [_episode_text(r, system) for _ in range(num_episodes)]
    # A few tool errors, so the words the agent sees on a bad call are not spelled by bytes.
    texts += [
        "error: tool call is not valid JSON",
        "error: unknown argument `expr`",
        "error: missing required argument `expression`",
    ] * 20
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE over Qwen2's split; specials take ids 0.. in the order listed above.

    The `tokenizers` trainer breaks ties between equally frequent pairs by pair id, so the
    merges do not depend on hash order: the result is deterministic.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[*CONTROL_TOKENS, *MARKUP_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return _unmark_markup(tok)


def _unmark_markup(tok: Tokenizer) -> Tokenizer:
    # The trainer registers every listed token as special; markup tokens are plain added
    # tokens (still matched whole, never split), as in Qwen's tokenizer.json.
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] in CONTROL_TOKENS
    return Tokenizer.from_str(json.dumps(data))


def _token_config(tok: Tokenizer) -> dict[str, Any]:
    decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in CONTROL_TOKENS,
        }
        for t in (*CONTROL_TOKENS, *MARKUP_TOKENS)
    }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_tiny_tokenizer(out_dir: str | Path) -> None:
    """Train the tiny tokenizer and write it, loadable by `AutoTokenizer`, to `out_dir`.

    `eos_token` is `<|im_end|>` (the end of a chat turn, as in Qwen2.5-Instruct), and
    generation stops on `<|im_end|>` or `<|endoftext|>`; padding has its own id.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(corpus())
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _token_config(tok))
    _write_json(
        out / "generation_config.json",
        {
            "eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id(EOS)],
            "pad_token_id": tok.token_to_id(PAD),
        },
    )
