"""`streamrl generate`: one-off generation from a Hugging Face checkpoint directory."""

from __future__ import annotations

import argparse
import json
import sys

from streamrl.model.spec import SpecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", help="generate from a checkpoint directory, once")
    g.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to sample at most")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (top-k 1)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument(
        "--chat-template",
        default="",
        metavar="FILE|chatml",
        help="chat template instead of the checkpoint's: a Jinja file, or `chatml` (the "
        "built-in ChatML with Hermes tool calls); --chat on a base model needs one",
    )
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k (0: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print token ids and text as JSON")


def main(args: argparse.Namespace) -> int:
    from streamrl.chat.hf import ChatError, HFChat, chat_template_text
    from streamrl.model.checkpoint import CheckpointError, load_checkpoint
    from streamrl.model.engine import Engine, EngineConfig
    from streamrl.model.sampling import GenRequest, SamplingParams

    try:
        template = chat_template_text(args.chat_template, "--chat-template")
        chat = HFChat.from_dir(args.checkpoint, template)
        if args.chat:
            chat.require_template("wrap the prompt in a chat (--chat)", "--chat-template")
        spec, params = load_checkpoint(args.checkpoint)
    except (ChatError, CheckpointError, SpecError) as err:
        print(f"streamrl generate: {err}", file=sys.stderr)
        return 2
    if args.chat:
        prompt = chat.prompt_ids([{"role": "user", "content": args.prompt}])
    else:
        prompt = chat.encode(args.prompt)
    n = args.max_new_tokens
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=1 if args.greedy else args.top_k,
    )
    cfg = EngineConfig(num_slots=1, kv_cache_size=len(prompt) + n + 1,
                       max_prompt_length=len(prompt), max_new_tokens=n, sampling=sampling,
                       stop_ids=tuple(chat.stop_ids), pad_id=chat.pad_id)  # fmt: skip
    try:
        [result] = Engine(spec, params, cfg).generate([GenRequest(prompt, n, args.seed)])
    except ValueError as err:
        print(f"streamrl generate: {err}", file=sys.stderr)
        return 2
    text = chat.decode(result.tokens)
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "token_ids": result.tokens, "text": text,
                          "logprobs": result.logprobs, "stopped": result.stopped}))  # fmt: skip
    else:
        print(text)
    return 0
