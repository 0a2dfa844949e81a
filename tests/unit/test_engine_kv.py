"""KV reuse across a session's turns (issue 18): the engine with a real (tiny, random) model.

A session here is what an agentic episode is to the engine: turn after turn, each prompt
the previous prompt, the tokens sampled for it, then some "tool result" tokens appended.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from streamrl.model.engine import Engine, EngineConfig, span_bucket, suffix_bucket
from streamrl.model.llm import init_params
from streamrl.model.sampling import GenRequest, GenResult
from tests.unit.test_engine import PARAMS, SAMPLING, SPEC, STOP, prompt, reference_logprobs

KV = 160  # positions per slot (the pool's rows are 160 wide: a multiple of 8)
TURN = 12  # tokens a turn may sample


def make_engine(reuse: bool, slots: int = 3, stop: tuple[int, ...] = (STOP,)) -> Engine:
    cfg = EngineConfig(
        num_slots=slots,
        kv_cache_size=KV,
        max_prompt_length=KV - TURN,
        max_new_tokens=TURN,
        sampling=SAMPLING,
        stop_ids=stop,
        pad_id=0,
        decode_chunk=4,
        max_prefill=4,
        kv_reuse=reuse,
    )
    return Engine(SPEC, PARAMS, cfg)


def seed_of(session: str, turn: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}:{turn}".encode(), digest_size=4).digest())


@dataclass
class Session:
    """One conversation: its transcript, the tool results it appends after each turn, and
    after how many engine steps it asks for its next turn (a tool's latency)."""

    name: str
    transcript: list[int]
    tools: list[list[int]]
    delays: list[int]
    results: list[GenResult] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    due: int = 0  # the step at which the next request goes in
    handle: int = -1

    @property
    def turn(self) -> int:
        return len(self.results)

    def request(self) -> GenRequest:
        self.prompts.append(list(self.transcript))
        return GenRequest(
            list(self.transcript), TURN, seed=seed_of(self.name, self.turn), session=self.name
        )


def sessions(seed: int, n: int, turns: int) -> list[Session]:
    """n sessions of `turns` turns: first prompts of 8..40 tokens, tool results of 1..24,
    tool latencies of 0..6 engine steps."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append(
            Session(
                name=f"s{seed}-{i}",
                transcript=rng.integers(6, 97, int(rng.integers(8, 41))).tolist(),
                tools=[
                    rng.integers(6, 97, int(rng.integers(1, 25))).tolist() for _ in range(turns)
                ],
                delays=[int(rng.integers(0, 7)) for _ in range(turns)],
            )
        )
    return out


def play(engine: Engine, group: list[Session], turns: int, swap_at: int = -1) -> int:
    """Drive the sessions' turns through `engine` (submit and step, interleaved as tool
    latencies fall) until each has played `turns` turns or run out of room; the engine's
    sessions are ended at the end. `swap_at`: at that step, serve new params (the same
    values, a new tree: what a weight sync does). Returns the steps taken."""
    step = 0
    live = list(group)
    while live:
        for s in live:
            if s.handle < 0 and s.due <= step:
                s.handle = engine.submit(s.request())
        if step == swap_at:
            engine.set_params(PARAMS_COPY)
        done = dict(engine.step())
        step += 1
        assert step < 1000, "a turn never came back"
        for s in list(live):
            if s.handle in done:
                res = done.pop(s.handle)
                s.results.append(res)
                s.handle = -1
                s.transcript += res.tokens + s.tools[s.turn - 1]
                s.due = step + s.delays[s.turn - 1]
                if s.turn >= turns or len(s.transcript) > KV - TURN:
                    live.remove(s)
                    engine.end_session(s.name)
    return step


PARAMS_COPY = init_params(SPEC, 0, std=0.3)  # the same values as PARAMS, another tree


def test_reuse_samples_what_a_whole_prefill_samples() -> None:
    """Several turns of interleaved sessions on 3 slots (evictions forced), a weight swap
    in the middle: every turn's tokens are equal with reuse and without, log-probs equal to
    float32 rounding (measured 6.2e-6 at most, about half of them bit-equal; bounded at
    1e-5), and both match a plain
    forward."""
    turns = 6
    on, off = make_engine(True), make_engine(False)
    with_reuse, without = sessions(1, 4, turns), sessions(1, 4, turns)
    play(on, with_reuse, turns, swap_at=20)
    play(off, without, turns, swap_at=20)
    worst = 0.0
    same = total = 0
    for a, b in zip(with_reuse, without, strict=True):
        assert a.prompts == b.prompts and len(a.results) == len(b.results) > 2
        for p, ra, rb in zip(a.prompts, a.results, b.results, strict=True):
            assert ra.tokens == rb.tokens
            diff = np.abs(np.asarray(ra.logprobs) - np.asarray(rb.logprobs))
            worst = max(worst, float(diff.max()))
            same, total = same + int((diff == 0).sum()), total + len(diff)
            ref = reference_logprobs(p + ra.tokens, SAMPLING.temperature)[len(p) - 1 :]
            np.testing.assert_allclose(ra.logprobs, ref, atol=1e-4)
            assert ra.reused_tokens + ra.prefill_tokens == len(p) - 1
            assert rb.reused_tokens == 0 and rb.prefill_tokens in (0, len(p) - 1)
    print(f"max |logprob(reuse) - logprob(no reuse)| = {worst:.2e}; {same}/{total} bit-equal")
    assert worst <= 1e-5
    stats = on.kv_stats()
    print(stats, off.kv_stats())
    assert stats["reuse_hits"] > 5 and stats["evictions"] > 0 and stats["invalidated"] > 0
    assert stats["prefill_tokens"] < 0.7 * off.kv_stats()["prefill_tokens"]
    assert off.kv_stats()["reuse_hits"] == off.kv_stats()["parked"] == 0
    assert on.parked == 0 and not on.has_work()  # every session ended: nothing kept


def test_a_weight_swap_drops_parked_slots_and_in_flight_sequences_are_not_parked() -> None:
    e = make_engine(True, slots=2, stop=())
    p = prompt(3, 20)
    [r] = e.generate([GenRequest(p, TURN, seed=1, session="a")])
    assert e.parked == 1
    e.set_params(PARAMS_COPY)
    assert e.parked == 0 and e.kv_stats()["invalidated"] == 1
    # The next turn prefills its whole prompt under the new params.
    nxt = p + r.tokens + prompt(4, 5)
    [r2] = e.generate([GenRequest(nxt, TURN, seed=2, session="a")])
    assert (r2.reused_tokens, r2.prefill_tokens) == (0, len(nxt) - 1)
    assert e.parked == 1
    # A turn admitted before a swap finishes after it: its KV mixes both, not parked.
    e.end_session("a")
    h = e.submit(GenRequest(prompt(5, 20), TURN, seed=3, session="b"))
    e.step()
    e.set_params(PARAMS)
    done = dict(e.step())
    while h not in done:
        done.update(e.step())
    assert e.parked == 0


def test_cancel_and_end_session_free_the_slot() -> None:
    e = make_engine(True, slots=1, stop=())
    h = e.submit(GenRequest(prompt(1, 20), TURN, seed=1, session="a"))
    e.step()
    e.cancel(h)
    assert e.active == 0 and e.parked == 0  # a cancelled turn is not kept
    [r] = e.generate([GenRequest(prompt(1, 20), TURN, seed=1, session="a")])
    assert e.parked == 1
    e.end_session("a")
    assert e.parked == 0
    # The one slot is free again: a new session takes it without evicting anything.
    e.generate([GenRequest(prompt(2, 20), TURN, seed=2, session="b")])
    assert e.kv_stats()["evictions"] == 0
    # Another session's request evicts b's parked slot; b then prefills its whole prompt.
    e.generate([GenRequest(prompt(3, 20), TURN, seed=3, session="c")])
    assert e.kv_stats()["evictions"] == 1
    [rb] = e.generate([GenRequest(prompt(2, 30), TURN, seed=4, session="b")])
    assert (rb.reused_tokens, rb.prefill_tokens) == (0, 29)
    assert len(r.tokens) == TURN


def test_a_prompt_that_departs_from_the_kept_tokens_reuses_the_common_prefix() -> None:
    e = make_engine(True, slots=2, stop=())
    p = prompt(6, 30)
    [r] = e.generate([GenRequest(p, TURN, seed=1, session="a")])
    edited = p[:20] + prompt(7, 15)  # the transcript was rewritten after position 20
    [r2] = e.generate([GenRequest(edited, TURN, seed=2, session="a")])
    assert (r2.reused_tokens, r2.prefill_tokens) == (20, len(edited) - 1 - 20)
    [alone] = make_engine(False, slots=2, stop=()).generate([GenRequest(edited, TURN, seed=2)])
    assert r2.tokens == alone.tokens
    # float32 sums in another order (a prefix from the cache, a suffix prefill): 2.6e-6 apart
    # on an AVX-512 host with the tests' unoptimized compiles, so the file's 1e-5 (2e-6 held
    # on other hosts)
    np.testing.assert_allclose(r2.logprobs, alone.logprobs, atol=1e-5)
    assert len(r.tokens) == TURN


def test_a_suffix_window_past_the_slot_end_is_moved_back() -> None:
    """A 33-token suffix pads to 48; at position 114 that would overrun the 160-position
    slot, so the window starts at 112 and computes two kept positions again."""
    first = prompt(8, 103)
    engines = make_engine(True, slots=1, stop=()), make_engine(False, slots=1, stop=())
    results = []
    for e in engines:
        [r] = e.generate([GenRequest(first, TURN, seed=1, session="a")])
        nxt = first + r.tokens + prompt(9, 33)
        assert len(nxt) == 148
        [r2] = e.generate([GenRequest(nxt, TURN, seed=2, session="a")])
        results.append(r2)
    on, off = results
    assert (on.reused_tokens, on.prefill_tokens) == (114, 147 - 112)
    assert (off.reused_tokens, off.prefill_tokens) == (0, 147)
    assert on.tokens == off.tokens
    np.testing.assert_allclose(on.logprobs, off.logprobs, atol=1e-5)


def test_suffix_prefills_compile_a_bounded_set_of_shapes() -> None:
    """Without stop tokens every turn samples TURN tokens, so the same schedule replays
    exactly: the second run (other tokens, same lengths) compiles nothing, and prefills
    compiled at most one program per (rows, length) bucket: rows 1, 2, 4 (max_prefill 4)
    times whole-prompt lengths 64, 128, 160 and suffix lengths 16, 24, 32, 48, 64, 96,
    128, 160 (the slot's length caps the last)."""
    e = make_engine(True, slots=3, stop=())
    turns = 8
    group = sessions(2, 5, turns)
    play(e, group, turns)
    first = dict(e.compile_counts)
    assert first["prefill"] <= 3 * (3 + 8)
    again = sessions(2, 5, turns)
    for s in again:  # other tokens, the same lengths
        s.transcript = [(t + 7) % 91 + 6 for t in s.transcript]
        s.name += "-again"
    play(e, again, turns)
    assert e.compile_counts == first
    assert e.kv_stats()["reuse_hits"] > 0


def test_suffix_buckets() -> None:
    sizes = [suffix_bucket(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 129, 193, 257)]
    assert sizes == [16, 16, 24, 24, 32, 48, 48, 64, 192, 256, 384]
    assert len({suffix_bucket(n) for n in range(1, 4097)}) == 17  # 16, then 2 a doubling


def test_unplaced_counts_the_requests_that_found_no_slot_not_next_turns() -> None:
    """What adaptive admission reads as `waiting`: after a step, the requests the admission
    found no slot for (every slot decoding); a next turn queued for its own parked slot is
    not one (it takes that slot back)."""
    e = make_engine(True, slots=2, stop=())
    [r] = e.generate([GenRequest(prompt(1, 20), TURN, seed=1, session="a")])
    assert (e.parked, e.unplaced) == (1, 0)
    e.submit(GenRequest(prompt(1, 20) + r.tokens + prompt(2, 4), TURN, seed=2, session="a"))
    assert e.waiting == 1  # queued, its slot parked: held 1 + waiting 1 on 2 slots
    e.step()
    assert (e.active, e.unplaced) == (1, 0)  # it took its slot back
    e.submit(GenRequest(prompt(3, 20), TURN, seed=3, session="b"))
    e.submit(GenRequest(prompt(4, 20), TURN, seed=4, session="c"))
    e.step()
    assert (e.active, e.unplaced) == (2, 1)  # c found every slot decoding
    while e.has_work():
        e.step()
    assert e.unplaced == 0 and e.kv_stats()["evictions"] == 1  # c took a parked slot


def test_parked_and_empty_slots_cost_a_decode_call_nothing() -> None:
    """A decode call gathers the active slots' rows: sessions parked below an active slot
    (their episodes waiting on tools) do not widen it. Seven sessions park in slots 0-6; a
    new one takes slot 7 and decodes alone, one row a call (the engine before this decoded
    the first pow2(7 + 1) = 8 rows), sampling what it samples on an engine of its own; the
    parked sessions' keys/values are untouched (each next turn still reuses its prefix)."""
    e = make_engine(True, slots=8, stop=())
    firsts = [GenRequest(prompt(10 + i, 20), TURN, seed=i, session=f"p{i}") for i in range(7)]
    parked = e.generate(firsts)
    assert e.parked == 7 and e.active == 0
    before = e.kv_stats()
    new = GenRequest(prompt(30, 25), TURN, seed=99, session="new")
    [got] = e.generate([new])
    after = e.kv_stats()
    calls = after["decode_calls"] - before["decode_calls"]
    assert calls > 0 and after["decode_rows"] - before["decode_rows"] == calls
    assert after["decode_active"] - before["decode_active"] == calls  # no padding row
    # each call attended its one row's live span: the first bucket (64) for a 25-token
    # prompt and its turn, not the pool's length
    assert after["decode_positions"] - before["decode_positions"] == calls * span_bucket(
        25 + TURN, e.pool_len
    )
    [alone] = make_engine(True, slots=1, stop=()).generate([new])
    assert got.tokens == alone.tokens
    np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-5)
    # The parked sessions' next turns: each takes its slot back and samples what a whole
    # prefill samples.
    nexts = [
        GenRequest(f.prompt + r.tokens + prompt(40 + i, 6), TURN, seed=50 + i, session=f.session)
        for i, (f, r) in enumerate(zip(firsts, parked, strict=True))
    ]
    again = e.generate(nexts)
    assert all(
        r.reused_tokens == len(f.prompt) + TURN - 1 for f, r in zip(firsts, again, strict=True)
    )
    whole = make_engine(False, slots=8, stop=()).generate(nexts)
    for a, w in zip(again, whole, strict=True):
        assert a.tokens == w.tokens
        np.testing.assert_allclose(a.logprobs, w.logprobs, atol=1e-5)


def test_decode_calls_are_timed_by_their_rows_without_the_calls_that_compiled() -> None:
    """`decode_costs`: each decode call's wall time under its row bucket, with its active
    rows (adaptive admission's latency term); a call that traced a program is left out.
    Three sequences of one budget, no stop: every call is a bucket of 4 rows, 3 active."""
    e = make_engine(True, slots=4, stop=())
    assert set(e.decode_costs) == {1, 2, 4}
    batch = [GenRequest(prompt(10 + i, 20), TURN, seed=i) for i in range(3)]
    e.generate(batch)
    calls, traced = e.decode_calls, e.compile_counts["decode"]
    assert calls > traced >= 1
    c = e.decode_costs[4]
    assert c.calls == calls - traced and c.active == 3 * c.calls and c.seconds > 0
    assert e.decode_costs[1].calls == e.decode_costs[2].calls == 0
    e.generate(batch)  # the same shapes: nothing traced, every call timed
    assert e.compile_counts["decode"] == traced
    more = e.decode_costs[4]
    assert more.calls == c.calls + (e.decode_calls - calls) and more.seconds > c.seconds
