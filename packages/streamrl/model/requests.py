"""What a model call asks for and what it answers: plain data, no JAX, so that the parts
that only pass them on (the episode runner, the stub policy, the endpoint) start without
loading it. `streamrl.model.sampling` samples under these parameters (and re-exports them).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GenRequest", "GenResult", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature > 0; top_p in (0, 1] (1.0: off); top_k >= 0 (0: off)."""

    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class GenRequest:
    """A prompt's token ids, how many tokens it may sample, and its RNG seed in [0, 2^32).

    `session`: a key shared by the turns of one conversation (the episode's traj id); the
    engine may keep a finished turn's KV cache for the session's next request, whose prompt
    extends it ("": none, every request prefills its whole prompt).
    """

    prompt: list[int]
    max_new_tokens: int
    seed: int
    session: str = ""


@dataclass(frozen=True)
class GenResult:
    """Sampled tokens (a stop token, if sampled, is the last one) and their log-probs.

    `stopped` says a stop token ended the sample; otherwise max_new_tokens did.
    `started_ns`: when the server took the request to decode it (`time.time_ns()`; 0:
    not said), what splits a model call's time into queue and decode in traces.
    `prefill_tokens`: prompt positions the engine computed for this request (0 for a group
    member that copied another's prefill); `reused_tokens`: prompt positions it took from
    its session's kept KV cache instead.
    """

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    started_ns: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
