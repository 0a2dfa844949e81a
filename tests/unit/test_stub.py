"""The stub policy's parts alone: the model service, its dialogue, the trainer's step, and
the config rule. Timing bounds are generous: they tell overlap from serial calls, no more."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from streamrl.config import ConfigError, parse_config
from streamrl.model.sampling import GenRequest, GenResult
from streamrl.rollout.stub import STOP_ID, STUB_REPLY, StubDialogue, StubServer
from streamrl.trainer.step import build_batch
from streamrl.trainer.stub import STUB_PAD_ID, StubTrainStep, stub_state


def _request(max_new_tokens: int = 64) -> GenRequest:
    return GenRequest(prompt=list(b"hello"), max_new_tokens=max_new_tokens, seed=0)


def test_stub_answers_its_turn_tokens_after_its_latency() -> None:
    server = StubServer(latency_s=0.05, turn_tokens=16, version=3)

    async def go() -> tuple[float, GenResult, int]:
        start = time.monotonic()
        result, version = await server.generate(_request())
        return time.monotonic() - start, result, version

    elapsed, result, version = asyncio.run(go())
    assert 0.05 <= elapsed < 2.0
    assert version == 3
    assert result.stopped
    tokens, logprobs = result.tokens, result.logprobs
    assert len(tokens) == len(logprobs) == 16 and tokens[-1] == STOP_ID
    assert all(math.isfinite(lp) and lp < 0 for lp in logprobs)  # the trainer masks out all-0 rows
    assert server.steps == 1 and server.tokens_generated == 16


def test_stub_turn_cut_by_the_request_budget_is_not_stopped() -> None:
    server = StubServer(latency_s=0.0, turn_tokens=16)
    result, _ = asyncio.run(server.generate(_request(max_new_tokens=5)))
    assert len(result.tokens) == 5 and not result.stopped and STOP_ID not in result.tokens


def test_stub_calls_overlap_like_a_batched_engine() -> None:
    """50 calls of 0.2 s each: serially 10 s, overlapped about 0.2 s."""
    server = StubServer(latency_s=0.2, turn_tokens=4)

    async def go() -> float:
        start = time.monotonic()
        await asyncio.gather(*(server.generate(_request()) for _ in range(50)))
        return time.monotonic() - start

    elapsed = asyncio.run(go())
    assert 0.2 <= elapsed < 3.0
    assert server.steps == 50


def test_held_stub_makes_new_calls_wait_for_the_next_version() -> None:
    """Held (the follower's `pause` mode, or a colocated trainer's step from its own
    thread), new calls wait; the swap releases them, tagged with the new version."""
    server = StubServer(latency_s=0.0, turn_tokens=4, version=0)

    async def go() -> list[int]:
        await server.generate(_request())  # binds the server to this loop
        held = threading.Thread(target=server.hold)  # from another thread, as colocated
        held.start()
        held.join()
        await asyncio.sleep(0.05)  # the hold reaches the loop
        waiting = asyncio.create_task(server.generate(_request()))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await server.swap(None, 1)
        _, version = await asyncio.wait_for(waiting, 5)
        server.hold()
        server.release()  # a failed sync: go on with the version served
        _, again = await asyncio.wait_for(server.generate(_request()), 5)
        return [version, again]

    assert asyncio.run(go()) == [1, 1]
    assert server.swaps == 1


def test_stub_dialogue_is_utf8_bytes() -> None:
    d = StubDialogue([{"type": "function"}])
    assert d.prompt("hé") == list("hé".encode())
    result, _ = asyncio.run(StubServer(0.0, 40).generate(_request()))
    text = d.assistant(result.tokens)
    assert text == (STUB_REPLY * 4)[:39]  # 39 bytes, then the stop id
    assert "<tool_call>" not in text and "<answer>" not in text
    assert bytes(d.tool_results(["a", "b"])).decode() == "\na\nb\n"


def test_stub_train_step_counts_the_step_and_changes_nothing_else() -> None:
    state = stub_state()
    items = [
        (np.arange(6, dtype=np.int32), np.array([0, 0, 1, 1, 1, 0], np.uint8), np.full(6, -1.0))
        for _ in range(3)
    ]
    batch = build_batch(items, [0.5, -0.5, 0.0], STUB_PAD_ID)
    step = StubTrainStep(step_s=0.05)
    start = time.monotonic()
    new, metrics = step(state, batch)
    assert time.monotonic() - start >= 0.05
    assert int(new.step) == 1 and int(state.step) == 0
    np.testing.assert_array_equal(np.asarray(new.params["stub"]), np.asarray(state.params["stub"]))
    assert metrics == {"loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "num_tokens": 9.0}


def test_stub_refuses_a_warm_start() -> None:
    with pytest.raises(ConfigError, match=r"model\.init = \"warmstart\".*model\.kind = \"stub\""):
        parse_config({"model": {"kind": "stub", "init": "warmstart"}})
    assert parse_config({"model": {"kind": "stub"}}).model.init == "checkpoint"
