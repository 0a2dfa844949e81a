r"""Token-in, token-out chat for Hugging Face tokenizers and their chat templates.

An episode is kept as token ids and extended turn by turn; sampled text is never rendered
and re-tokenized, so the tokens trained on are exactly the tokens sampled. Only the parts
the policy did not write (the prompt, tool results, the next generation prompt) come from
the template, as the token ids of the text the template adds.

The turn boundary: a sampled assistant turn ends with its stop token (`<|im_end|>` for
ChatML), and that is where our tokens end. The template usually writes more after the
turn's end marker (ChatML: a newline). That text belongs to the *next* piece: a
continuation is the rendered text after the end of the last turn-end marker, so it starts
with the template's "\n" and runs to the next generation prompt:

    prompt        <|im_start|>user\nCompute 2+3 ...<|im_end|>\n<|im_start|>assistant\n
    sampled       <tool_call>{...}</tool_call><|im_end|>
    continuation  \n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n
                  <|im_start|>assistant\n
    sampled       <answer>5</answer><|im_end|>

A finished episode ends at its last stop token; the template's trailing "\n" is not in it.
Each boundary sits after a special token (never merged with its neighbours) or after the
generation prompt's final newline (where Qwen/GPT-style pre-tokenizers split), so the
pieces concatenated equal the whole transcript rendered and tokenized at once, as long as
the policy sampled the tokenizer's own ids for its text and did not open its turn with
whitespace. When it did, the pieces still hold exactly what it sampled.

Rendering goes to text, encoded with `add_special_tokens=False`: the same as
`apply_chat_template(tokenize=True)` does; the template writes any BOS itself. Tool calls
are Hermes style, parsed by `streamrl.chat.transcript.parse_turn`. Imports transformers (only the
rollout and trainer load this module), never JAX or torch.

A base model's tokenizer may ship no chat template. It still loads: raw text encodes and
decodes, and its eos ends generation. What needs a template (rendering, prompts, dialogues,
demonstration turns) raises `ChatError` naming `model.chat_template`, which supplies one:
a Jinja file, or `chatml`, the built-in ChatML template with Hermes tool calls (the tiny
model's, `streamrl.chat.tiny_tokenizer.CHAT_TEMPLATE`). A ChatML template needs `<|im_start|>`
and `<|im_end|>` to be single tokens of the tokenizer (a turn ends on a stop *id*, and
the marker must not be forgeable as text); when they are not, loading fails naming the
missing tokens rather than encoding them as text. Qwen base tokenizers have them; for
others (Llama 3 base), write a template in the tokenizer's own turn tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from streamrl.chat.tiny_tokenizer import CHAT_TEMPLATE as CHATML_TEMPLATE
from streamrl.chat.transcript import ParsedTurn, parse_turn
from streamrl.config import ModelConfig
from streamrl.errors import FatalError
from streamrl.jsontypes import JSON, JSONObject

Message = JSONObject
Tools = list[JSONObject]
# A conversation as `render` takes it: messages of JSON values, read and never changed.
Messages = Sequence[Mapping[str, JSON]]

# Files of which at least one marks a directory as holding a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CHATML_START = "<|im_start|>"
CHATML_END = "<|im_end|>"
BUILTIN_TEMPLATE = "chatml"  # the `model.chat_template` value naming CHATML_TEMPLATE
TEMPLATE_OPTION = "model.chat_template"
# Put after the first character of a token's text found in outside content: the text
# stays readable and encodes as plain text, never as that token.
ZERO_WIDTH_SPACE = "\u200b"
# A conversation rendered once at load time to find the text that ends an assistant turn.
_PROBE_REPLY = "Hello there"
_PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_REPLY})


class ChatError(ValueError):
    """A tokenizer directory or chat template that token-in, token-out chat cannot use."""


class ModelChatError(ChatError, FatalError):
    """A run's checkpoint and `model.chat_template` give no usable chat: a restarted
    worker would fail the same way, so `streamrl up` stops at once."""


class Dialogue(Protocol):
    """One episode's chat as token ids: what the episode loop needs from a chat layout.

    `prompt` opens the episode (ids ending with the generation prompt); `assistant` records
    a sampled turn (its ids, ending with the stop token when it stopped) and returns its text
    for parsing; `tool_results` returns the ids that follow that turn up to the next
    generation prompt. None of the returned ids are trained on.
    """

    def prompt(self, user_text: str) -> list[int]: ...

    def assistant(self, ids: list[int]) -> str: ...

    def tool_results(self, results: list[str]) -> list[int]: ...


class HFChat:
    """A Hugging Face tokenizer with its chat template, as token-in, token-out chat.

    Also a tokenizer (`vocab_size`, `pad_id`, `encode`,
    `decode`, `token_id`), so the generator and the episode loop can take it in place of
    the character tokenizer.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: Sequence[int],
        chat_template: str | None = None,
        name: str = "the tokenizer",
    ) -> None:
        """`chat_template` overrides the tokenizer's own; `stop_ids` end a sampled turn;
        `name` says where the tokenizer came from, in errors."""
        if not stop_ids:
            raise ChatError("no stop token: the tokenizer has no eos and none was given")
        self.tok = tokenizer
        self.template = chat_template or None  # "" too means the tokenizer's own
        self.name = name
        self._stop_ids = tuple(dict.fromkeys(stop_ids))  # ordered, without repeats
        for i in self._stop_ids:
            text = self.decode([i])
            if self.encode(text) != [i]:
                raise ChatError(f"stop token {i} ({text!r}) does not encode back to one id")
        # Found now, so a template that cannot be used fails at load, not mid-episode.
        self._turn_end = self._find_turn_end() if self.has_template else None
        added = sorted((t for t in tokenizer.get_added_vocab() if len(t) > 1), key=len)
        self._added = re.compile("|".join(re.escape(t) for t in reversed(added))) if added else None

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> HFChat:
        """Load the tokenizer in `path` (local files only); stop ids from it and the template.

        Stop ids: the tokenizer's eos, then `generation_config.json`'s `eos_token_id` (an int
        or a list), then `<|im_end|>` when the template is ChatML. Without any template
        (a base model's tokenizer, no `chat_template`) only raw text works.
        """
        path = Path(path)
        tok = _load_tokenizer(path)
        template = chat_template or tok.chat_template
        stops = [tok.eos_token_id] if isinstance(tok.eos_token_id, int) else []
        stops += _generation_eos_ids(path)
        if template and CHATML_START in str(template):  # a str, or a dict of named templates
            missing = [t for t in (CHATML_START, CHATML_END) if len(_encode(tok, t)) != 1]
            if missing:
                raise ChatError(
                    f"the chat template is ChatML, but {' and '.join(missing)} "
                    f"{'is not a token' if len(missing) == 1 else 'are not tokens'} of the "
                    f"tokenizer in {path} (each must be one id: a turn ends on a stop id); "
                    f"set {TEMPLATE_OPTION} to a template written in this tokenizer's own "
                    "turn tokens"
                )
            stops.append(_single_token_id(tok, CHATML_END, path))
        return cls(tok, stops, chat_template, f"the tokenizer in {path}")

    @classmethod
    def for_model(cls, path: str | Path, model: ModelConfig) -> HFChat:
        """The chat of a run's policy: the tokenizer in checkpoint directory `path` with
        the template `model.chat_template` names (`chat_template_text`).

        A run needs a template (episodes, warm-start demonstrations), so the result always
        has one; any problem is a `ModelChatError`, which stops the run instead of
        restarting its workers.
        """
        try:
            chat = cls.from_dir(path, chat_template_text(model.chat_template))
            chat.require_template("run episodes")
        except ChatError as err:
            raise ModelChatError(str(err)) from err
        return chat

    @property
    def has_template(self) -> bool:
        """Whether there is a chat template (given, or the tokenizer's own)."""
        return bool(self.template or self.tok.chat_template)

    def require_template(self, purpose: str, option: str = TEMPLATE_OPTION) -> None:
        """`ChatError` when there is no template to `purpose` with, naming `option` (the
        setting that gives one) as the fix."""
        if not self.has_template:
            raise ChatError(
                f"{self.name} has no chat template (a base model's), so it cannot {purpose}: "
                f"set {option} to a Jinja template file, or to `{BUILTIN_TEMPLATE}` for the "
                "built-in ChatML template with Hermes tool calls"
            )

    @property
    def turn_end_id(self) -> int:
        """The stop token the template writes after an assistant's text."""
        return self._turn_end_marker()[0]

    @property
    def turn_end(self) -> str:
        """The text of `turn_end_id`."""
        return self._turn_end_marker()[1]

    def _turn_end_marker(self) -> tuple[int, str]:
        if self._turn_end is None:
            self.require_template("end an assistant turn")
        assert self._turn_end is not None  # has_template implies it was found at load
        return self._turn_end

    # The Tokenizer protocol.

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included (HF's `vocab_size` leaves those out)."""
        return len(self.tok)

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad id; without one, the first stop id (pad positions are masked)."""
        pad = self.tok.pad_token_id
        return pad if isinstance(pad, int) else self._stop_ids[0]

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token text becomes its one id, and no BOS/EOS is added."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens kept (so `<tool_call>` blocks still parse)."""
        text = self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def token_id(self, token: str) -> int:
        return _single_token_id(self.tok, token, "the tokenizer")

    def as_text(self, text: str) -> str:
        """`text` with every added token's text in it broken (a zero-width space after its
        first character), so it encodes as text, never as those tokens: content from
        outside the policy (prompts, tool results, environment replies) cannot open,
        close or forge a turn (`<|im_end|>\n<|im_start|>assistant` in a tool's output is
        just characters)."""
        if self._added is None:
            return text
        return self._added.sub(lambda m: m.group(0)[0] + ZERO_WIDTH_SPACE + m.group(0)[1:], text)

    # Chat.

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end a model turn."""
        return self._stop_ids

    def render(
        self, messages: Messages, tools: Tools | None = None, generation_prompt: bool = False
    ) -> str:
        """The template's text of `messages` (and `tools`, listed as the template does)."""
        self.require_template("render a conversation")
        # transformers also takes callables as tools; ours are JSON schemas.
        schemas: list[JSONObject] | None = None
        if tools is not None:
            schemas = [*tools]
        try:
            text = self.tok.apply_chat_template(
                messages,
                tools=schemas,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as err:
            raise ChatError(f"the chat template rejected the conversation: {err}") from err
        assert isinstance(text, str)  # tokenize=False on one conversation gives its text
        return text

    def prompt_ids(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        """Ids of `messages` followed by the generation prompt: where sampling starts."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def continuation_ids(
        self,
        messages_so_far: Messages,
        new_messages: Messages,
        tools: Tools | None = None,
    ) -> list[int]:
        """Ids that follow a sampled assistant turn: `new_messages`, then the generation prompt.

        `messages_so_far` ends with that assistant turn, whose ids (ending with its stop
        token) the caller already holds. The result is the text the template renders after
        that turn's end marker (see the module docstring), so it starts with whatever the
        template writes between turns. The new rendering must start with the old one up to
        that marker, the part held as ids, or `ChatError`; what the old one wrote after the
        marker was never added, so it may change.
        """
        if not messages_so_far or messages_so_far[-1].get("role") != "assistant":
            raise ChatError("a continuation follows a sampled assistant turn, the last message")
        if not new_messages:
            raise ChatError("a continuation needs at least one new message")
        cut = self._turn_end_in(self.render(messages_so_far, tools), messages_so_far[-1])
        full = self.render([*messages_so_far, *new_messages], tools, generation_prompt=True)
        if not full.startswith(cut):
            differ = (i for i, (a, b) in enumerate(zip(cut, full, strict=False)) if a != b)
            at = next(differ, min(len(cut), len(full)))
            raise ChatError(
                "template is not prefix-stable: adding "
                f"{[m.get('role') for m in new_messages]} messages changes the text before "
                f"them at char {at} ({cut[at : at + 40]!r} became {full[at : at + 40]!r}), so "
                "the ids already sampled would not match the rendered conversation"
            )
        return self.encode(full[len(cut) :])

    def assistant_text(self, ids: list[int]) -> str:
        """Text of a sampled turn, without its stop token (the template writes its own)."""
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def assistant_message(self, ids: list[int]) -> Message:
        """A sampled turn as a message, its text verbatim (tool calls included), for `render`."""
        return {"role": "assistant", "content": self.assistant_text(ids)}

    def parse(self, ids: list[int]) -> ParsedTurn:
        """Hermes `<tool_call>` calls and the `<answer>` of a sampled turn."""
        return parse_turn(self.assistant_text(ids))

    def assistant_turn(self, text: str) -> list[int]:
        """Ids of a whole assistant turn as the policy would sample it (demonstrations)."""
        return [*self.encode(text), self.turn_end_id]

    def dialogue(self, tools: Tools | None = None, system: str | None = None) -> HFDialogue:
        """A fresh episode's conversation, with `tools` listed by the template."""
        self.require_template("hold a dialogue")
        return HFDialogue(self, tools, system)

    def _find_turn_end(self) -> tuple[int, str]:
        # The stop token the template writes after an assistant's text; demonstrations end
        # with it, and continuations are cut after it.
        text = self.render(list(_PROBE))
        after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY) :].lstrip()
        for i in self._stop_ids:
            if after.startswith(stop := self.decode([i])):
                return i, stop
        raise ChatError(
            f"the chat template ends an assistant turn with {after[:20]!r}, which starts with "
            f"none of the stop tokens {[self.decode([i]) for i in self._stop_ids]}"
        )

    def _turn_end_in(self, text: str, last: Mapping[str, JSON]) -> str:
        """`text` up to and including the end marker of its last (assistant) turn."""
        end = text.rfind(self.turn_end)
        # The turn is the text since the previous end marker; its content must be there,
        # or the template left the last turn open and `end` belongs to an earlier one.
        start = max(text.rfind(self.turn_end, 0, max(end, 0)), 0)
        content = str(last.get("content") or "").strip()
        if end < 0 or content not in text[start:end]:
            raise ChatError(
                f"the chat template does not close the last assistant turn with {self.turn_end!r}"
            )
        return text[: end + len(self.turn_end)]


class HFDialogue:
    """One episode's conversation: the messages so far, so each continuation can be rendered.

    Satisfies `Dialogue`. Tool results go back as `tool` messages, which Hermes/Qwen
    templates place in a user turn as `<tool_response>` blocks. Content from outside the
    policy goes in through `HFChat.as_text`: it cannot hold a control token.
    """

    def __init__(self, chat: HFChat, tools: Tools | None, system: str | None) -> None:
        self.chat = chat
        self.tools = tools
        self.messages: list[Message] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})

    def prompt(self, user_text: str) -> list[int]:
        self.messages.append({"role": "user", "content": self.chat.as_text(user_text)})
        return self.chat.prompt_ids(self.messages, self.tools)

    def assistant(self, ids: list[int]) -> str:
        message = self.chat.assistant_message(ids)
        self.messages.append(message)
        return str(message["content"])

    def tool_results(self, results: list[str]) -> list[int]:
        return self._extend([{"role": "tool", "content": self.chat.as_text(r)} for r in results])

    def user(self, text: str) -> list[int]:
        """Ids of a user message after a sampled turn (an environment's reply)."""
        return self._extend([{"role": "user", "content": self.chat.as_text(text)}])

    def _extend(self, new: list[Message]) -> list[int]:
        ids = self.chat.continuation_ids(self.messages, new, self.tools)
        self.messages.extend(new)
        return ids


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if not path.is_dir():
        raise ChatError(f"tokenizer directory {path} does not exist")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ChatError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ChatError(f"cannot load the tokenizer in {path}: {err}") from err
    if not isinstance(tok, PreTrainedTokenizerBase):
        raise ChatError(f"{path} holds a {type(tok).__name__}, not a text tokenizer")
    return tok


def _generation_eos_ids(path: Path) -> list[int]:
    """`eos_token_id` of `generation_config.json` (int, list or absent) as a list."""
    f = path / "generation_config.json"
    if not f.is_file():
        return []
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ChatError(f"{f} is not a JSON object: {err}") from err
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ChatError(f"{f}: eos_token_id must be an int or a list of ints, not {eos!r}")
    return ids


def chat_template_text(value: str, option: str = TEMPLATE_OPTION) -> str | None:
    """The template `value` of `option` names: None for "" (the checkpoint's own), the
    built-in ChatML template for `chatml`, else the text of the Jinja file at that path."""
    if not value:
        return None
    if value == BUILTIN_TEMPLATE:
        return CHATML_TEMPLATE
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatError(
            f"{option} = {value!r}: no such file (give a Jinja chat template file, or "
            f"`{BUILTIN_TEMPLATE}` for the built-in one)"
        )
    return path.read_text(encoding="utf-8")


def _encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _single_token_id(tok: PreTrainedTokenizerBase, token: str, where: object) -> int:
    ids = _encode(tok, token)
    if len(ids) != 1:
        raise ChatError(f"{token!r} is not one token in {where} (it encodes to {ids})")
    return int(ids[0])
