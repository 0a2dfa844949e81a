"""Tokenizer of the tiny built-in policy, and the interface a real one fills.

The tiny default model uses a character tokenizer with a handful of special tokens
(`<|user|>`, `<tool_call>`, ...), each one id. A Hugging Face tokenizer slots in behind the
same `Tokenizer` protocol (a later issue). Imports no JAX.
"""

from __future__ import annotations

from typing import Protocol

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<unk>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
)


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_id(self, token: str) -> int: ...


class CharTokenizer:
    """Specials by longest match, then one id per printable ASCII character or newline.

    Unknown characters map to `<unk>`. The vocabulary is padded to 128 ids.
    """

    VOCAB_SIZE = 128

    def __init__(self) -> None:
        chars = ["\n", *(chr(c) for c in range(32, 127))]
        self._id_to_tok: list[str] = [*SPECIAL_TOKENS, *chars]
        if len(self._id_to_tok) > self.VOCAB_SIZE:
            raise AssertionError("character vocabulary overflows VOCAB_SIZE")
        self._tok_to_id = {t: i for i, t in enumerate(self._id_to_tok)}
        # Longest specials first so that `</tool_call>` is never read as `<` + ...
        self._specials = sorted(SPECIAL_TOKENS, key=len, reverse=True)
        self._unk = self._tok_to_id["<unk>"]

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def pad_id(self) -> int:
        return self._tok_to_id["<pad>"]

    def token_id(self, token: str) -> int:
        return self._tok_to_id[token]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        n = len(text)
        while i < n:
            if text[i] == "<":
                for s in self._specials:
                    if text.startswith(s, i):
                        ids.append(self._tok_to_id[s])
                        i += len(s)
                        break
                else:
                    ids.append(self._tok_to_id["<"])
                    i += 1
                continue
            ids.append(self._tok_to_id.get(text[i], self._unk))
            i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        out = []
        for t in ids:
            if 0 <= t < len(self._id_to_tok):
                out.append(self._id_to_tok[t])
            else:
                out.append("<unk>")
        return "".join(out)
