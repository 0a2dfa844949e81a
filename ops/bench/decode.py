"""Decode throughput of the continuous-batching engine against transformers' generate.

    .venv/bin/python ops/bench/decode.py [--concurrency 1 8 32 64] [--threads 2]
        [--rows all | decode bf16 agentic parked] [--agentic-episodes 64] [--agentic-turns 8]

A ~20 M parameter Qwen2-family model with random weights (built locally, no download);
prompts of 128 random tokens, 128 sampled tokens each (temperature 1, no stop token, so
every sequence runs to its budget). For each concurrency C it measures, side by side:

- engine:        C sequences submitted at once to an engine of C slots;
- engine b=1:    the same engine code with one slot, sequences one after another;
- hf serial:     transformers' PyTorch `generate`, one sequence at a time;
- hf batched:    transformers' `generate` on all C sequences as one batch;
- full span:     the engine attending over every cache position at each decode step
                 (`live_span` off: the previous engine), and the engine's ratio to it;
- engine g4:     the same C sequences as C/4 prompts of 4 members each (a GRPO group of
                 4 shares its prompt's prefill), the rollout worker's real workload;
- bound:         2 x params FLOPs per generated token against a dense float32 matmul timed
                 in the same run (the machine's matmul rate), and the engine's fraction of
                 it; `of work` also counts the prompt's tokens (prefill is half the FLOPs of
                 a 128 + 128 sequence), i.e. the fraction of the matmul rate the engine
                 sustains over all the work it does.

Tokens/s are medians over `--repeats` runs; ratios are engine over each baseline.

The bf16 rows: the same checkpoint loaded in bfloat16 by both stacks (the engine as
`model.dtype = "bfloat16"` serves it: bf16 matmuls with float32 results, a float32 KV pool
on a CPU; transformers with `dtype=torch.bfloat16`), beside the float32 engine. On a CPU
with bfloat16 matrix units (AMX) both take them.

The parked row (`--rows parked`, issue 29 item 4): C/2 sequences decoding on an engine of C
slots while C/2 sessions sit parked in the slots below them (episodes whose tools are
running), against the same C/2 sequences with nothing parked. A decode call gathers the
active rows, so the ratio is about 1; the engine before decoded the first pow2(highest
active slot) rows, parked ones included (C rows for C/2 sequences). No torch needed.

The agentic row (issue 18): `--agentic-episodes` concurrent episodes (64) of
`--agentic-turns` model turns (8) of 48 sampled tokens each, a 128-token first prompt and,
after each turn, a 128-token tool result (a stub tool: random ids, no latency), on an
engine of one slot per episode (`--agentic-slots` fewer forces evictions). With KV reuse
(`rollout.kv_reuse`) each turn prefills what the last one added; without, the whole
transcript. Reported: sampled tokens/s, prefill tokens per episode against its final
transcript's length, reuse hits and evictions per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.sampling import GenRequest, SamplingParams
from streamrl.model.spec import ModelSpec

PROMPT, RESPONSE = 128, 128
SPEC_CONFIG = {
    "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 512, "tie_word_embeddings": True,
}  # fmt: skip
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(repeats: int) -> float:
    """FLOP/s of a dense float32 matmul (n = 1024) with JAX on this machine."""
    n = 1024
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = median_time(lambda: f(a).block_until_ready(), max(5, repeats * 3))
    return 2 * n**3 / t


def prompts(n: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    # Ids from 2 up: 0 is the pad id, 1 the (never emitted here) stop id.
    return [rng.integers(2, vocab, PROMPT).tolist() for _ in range(n)]


def decode_engine(spec: ModelSpec, params: object, slots: int, live_span: bool = True) -> Engine:
    """An engine of `slots` slots for PROMPT-token prompts and RESPONSE sampled tokens."""
    cfg = EngineConfig(num_slots=slots, kv_cache_size=PROMPT + RESPONSE,
                       max_prompt_length=PROMPT, max_new_tokens=RESPONSE, sampling=SAMPLING,
                       stop_ids=(), pad_id=0, decode_chunk=16, max_prefill=16,
                       live_span=live_span)  # fmt: skip
    return Engine(spec, params, cfg)


def engine_rate(
    spec: ModelSpec,
    params: object,
    slots: int,
    seqs: int,
    repeats: int,
    group: int = 1,
    live_span: bool = True,
) -> float:
    engine = decode_engine(spec, params, slots, live_span)
    distinct = prompts(-(-seqs // group), spec.vocab_size)
    reqs = [GenRequest(distinct[i // group], RESPONSE, seed=i) for i in range(seqs)]
    engine.generate(reqs)  # compile every shape this run uses
    t = median_time(lambda: engine.generate(reqs), repeats)
    return seqs * RESPONSE / t


AGENT_TURN, AGENT_TOOL = 48, 128


def agentic_row(
    spec: ModelSpec,
    params: object,
    episodes: int,
    turns: int,
    slots: int,
    reuse: bool,
    repeats: int,
) -> dict[str, float]:
    """Sampled tokens/s and, per run, prefill tokens per episode, reuse hits, evictions."""
    kv = PROMPT + (turns - 1) * (AGENT_TURN + AGENT_TOOL) + AGENT_TURN
    cfg = EngineConfig(num_slots=slots, kv_cache_size=kv, max_prompt_length=kv - AGENT_TURN,
                       max_new_tokens=AGENT_TURN, sampling=SAMPLING, stop_ids=(), pad_id=0,
                       decode_chunk=16, max_prefill=16, kv_reuse=reuse)  # fmt: skip
    engine = Engine(spec, params, cfg)
    rng = np.random.default_rng(2)
    firsts = prompts(episodes, spec.vocab_size)
    tools = rng.integers(2, spec.vocab_size, (episodes, turns, AGENT_TOOL)).tolist()
    runs = iter(range(1 << 30))

    def run() -> None:
        r = next(runs)  # each run its own sessions (and seeds): nothing kept from the last
        transcripts = [list(p) for p in firsts]
        turn = [0] * episodes
        handles = {}
        for e in range(episodes):
            req = GenRequest(transcripts[e], AGENT_TURN, seed=e, session=f"{r}-{e}")
            handles[engine.submit(req)] = e
        while handles:
            for handle, result in engine.step():
                e = handles.pop(handle)
                turn[e] += 1
                if turn[e] == turns:
                    engine.end_session(f"{r}-{e}")
                    continue
                transcripts[e] += result.tokens + tools[e][turn[e] - 1]
                req = GenRequest(transcripts[e], AGENT_TURN, seed=e * turns + turn[e],
                                 session=f"{r}-{e}")  # fmt: skip
                handles[engine.submit(req)] = e

    run()  # compile every shape this schedule uses
    before = engine.kv_stats()
    t = median_time(run, repeats)
    after = engine.kv_stats()
    per_run = {k: (after[k] - before[k]) / repeats for k in after}
    return {
        "rate": episodes * turns * AGENT_TURN / t,
        "prefill": per_run["prefill_tokens"] / episodes,
        "hits": per_run["reuse_hits"],
        "evictions": per_run["evictions"],
        "transcript": kv,
    }


def parked_rate(spec: ModelSpec, params: object, slots: int, repeats: int, parked: bool) -> float:
    """Sampled tokens/s of slots/2 sequences on an engine of `slots` slots, with (`parked`)
    or without slots/2 sessions parked in the slots below them (agentic episodes whose
    tools are running: their slots keep their keys/values for their next turn)."""
    half = max(1, slots // 2)
    engine = decode_engine(spec, params, slots)
    texts = prompts(2 * half, spec.vocab_size)

    def once(r: int) -> float:
        """Seconds of the decode alone (the parking turns before it are not timed)."""
        sessions = [f"{r}-{i}" for i in range(half)] if parked else []
        engine.generate([GenRequest(texts[i], 8, seed=i, session=s)
                         for i, s in enumerate(sessions)])  # fmt: skip
        start = time.perf_counter()
        engine.generate([GenRequest(texts[half + i], RESPONSE, seed=i) for i in range(half)])
        took = time.perf_counter() - start
        for s in sessions:
            engine.end_session(s)
        return took

    once(0)  # compile every shape this run uses
    return half * RESPONSE / statistics.median(once(r) for r in range(1, repeats + 1))


def print_parked(spec: ModelSpec, params: object, args: argparse.Namespace) -> None:
    """C/2 sequences decoding above C/2 parked sessions, against the same C/2 sequences on
    the same engine with nothing parked (the baseline: a decode call of C/2 rows)."""
    print("parked: C/2 sequences decoding above C/2 parked sessions vs nothing parked")
    print(f"{'C':>3} {'parked below':>12} {'nothing parked':>14} {'x nothing parked':>16}")
    for c in args.concurrency:
        if c < 2:
            continue
        below = parked_rate(spec, params, c, args.repeats, parked=True)
        alone = parked_rate(spec, params, c, args.repeats, parked=False)
        print(f"{c:>3} {below:>12.0f} {alone:>14.0f} {below / alone:>16.2f}", flush=True)


def print_agentic(spec: ModelSpec, params: object, args: argparse.Namespace) -> None:
    n, turns = args.agentic_episodes, args.agentic_turns
    slots = args.agentic_slots or n
    print(f"agentic: {n} episodes x {turns} turns of {AGENT_TURN} tokens, {AGENT_TOOL}-token "
          f"tool results, {slots} slots")  # fmt: skip
    print(f"{'kv reuse':>8} {'tokens/s':>8} {'x off':>6} {'prefill/episode':>15} "
          f"{'transcript':>10} {'reuse hits':>10} {'evictions':>9}")  # fmt: skip
    rows = {}
    for reuse in (False, True):
        rows[reuse] = agentic_row(spec, params, n, turns, slots, reuse, args.repeats)
    for reuse in (False, True):
        row = rows[reuse]
        print(
            f"{'on' if reuse else 'off':>8} {row['rate']:>8.0f} "
            f"{row['rate'] / rows[False]['rate']:>6.2f} {row['prefill']:>15.0f} "
            f"{row['transcript']:>10} {row['hits']:>10.0f} {row['evictions']:>9.0f}",
            flush=True,
        )


def hf_rate(ckpt: Path, batch: int, repeats: int, bf16: bool = False) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True, dtype=dtype).eval()
    ids = torch.tensor(prompts(batch, model.config.vocab_size))
    model.generation_config.eos_token_id = None  # run every sequence to its budget
    model.generation_config.pad_token_id = 0

    def run() -> None:
        with torch.no_grad():
            model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=RESPONSE, min_new_tokens=RESPONSE)  # fmt: skip

    run()
    return batch * RESPONSE / median_time(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=("all", "decode", "bf16", "agentic", "parked"),
        default=["all"],
    )
    parser.add_argument("--agentic-episodes", type=int, default=64)
    parser.add_argument("--agentic-turns", type=int, default=8)
    parser.add_argument("--agentic-slots", type=int, default=0, help="0: one per episode")
    args = parser.parse_args()
    rows = {"decode", "bf16", "agentic", "parked"} if "all" in args.rows else set(args.rows)
    if rows & {"decode", "bf16"}:  # transformers' rows: torch, a test-time reference only
        import torch

        torch.set_num_threads(args.threads)
    spec = ModelSpec.from_config(SPEC_CONFIG)
    with tempfile.TemporaryDirectory() as tmp:
        from streamrl.model.checkpoint import build_tiny_checkpoint

        build_tiny_checkpoint(tmp, spec, seed=0)
        spec, params = load_checkpoint(tmp)
        flops = matmul_flops(args.repeats)
        bound = flops / (2 * spec.num_params())
        print(
            f"model: {spec.num_params() / 1e6:.1f} M params; matmul {flops / 1e9:.1f} GFLOP/s;"
            f" bound {bound:.0f} tokens/s; jax {jax.__version__} on {jax.default_backend()};"
            f" torch threads {args.threads}; cpus {os.cpu_count()}"
        )
        if "parked" in rows:
            print_parked(spec, params, args)
        if "agentic" in rows:
            print_agentic(spec, params, args)
        if "decode" in rows:
            print_decode(spec, params, Path(tmp), args, bound)
        if "bf16" in rows:
            print_bf16(spec, params, Path(tmp), args)


def print_bf16(spec: ModelSpec, params: object, ckpt: Path, args: argparse.Namespace) -> None:
    """The same checkpoint served in bfloat16 by both (model.dtype = "bfloat16"), against
    the float32 engine (`params`): both stacks then run their matmuls on the CPU's bfloat16
    units."""
    _, params16 = load_checkpoint(ckpt, dtype=jnp.bfloat16)
    print("bfloat16: engine and transformers' batched generate both in bfloat16")
    print(f"{'C':>3} {'engine bf16':>11} {'hf bf16':>7} {'x hf bf16':>9} {'engine f32':>10} "
          f"{'bf16 x f32':>10}")  # fmt: skip
    for c in args.concurrency:
        ours = engine_rate(spec, params16, c, c, args.repeats)
        f32 = engine_rate(spec, params, c, c, args.repeats)
        hf = hf_rate(ckpt, c, max(1, args.repeats - 1), bf16=True)
        print(f"{c:>3} {ours:>11.0f} {hf:>7.0f} {ours / hf:>9.2f} {f32:>10.0f} "
              f"{ours / f32:>10.2f}", flush=True)  # fmt: skip


def print_decode(
    spec: ModelSpec, params: object, tmp: Path, args: argparse.Namespace, bound: float
) -> None:
    single = engine_rate(spec, params, 1, 2, args.repeats)
    hf_serial = hf_rate(tmp, 1, args.repeats)
    work = (PROMPT + RESPONSE) / RESPONSE  # FLOPs per generated token, prefill included
    header = (f"{'C':>3} {'engine':>7} {'engine b=1':>10} {'hf serial':>9} "
              f"{'hf batched':>10} {'x b=1':>6} {'x hf ser':>8} {'x hf bat':>8} "
              f"{'of bound':>8} {'of work':>7} {'engine g4':>9} {'g4 x hf bat':>11} "
              f"{'g4 of bound':>11} {'full span':>9} {'x full':>6}")  # fmt: skip
    print(header)
    for c in args.concurrency:
        ours = engine_rate(spec, params, c, c, args.repeats)
        grouped = engine_rate(spec, params, c, c, args.repeats, group=min(4, c))
        full = engine_rate(spec, params, c, c, args.repeats, live_span=False)
        hf_batched = hf_rate(tmp, c, max(1, args.repeats - 1))
        print(
            f"{c:>3} {ours:>7.0f} {single:>10.0f} {hf_serial:>9.0f} {hf_batched:>10.0f} "
            f"{ours / single:>6.2f} {ours / hf_serial:>8.2f} {ours / hf_batched:>8.2f} "
            f"{ours / bound:>8.2f} {ours * work / bound:>7.2f} {grouped:>9.0f} "
            f"{grouped / hf_batched:>11.2f} {grouped / bound:>11.2f} {full:>9.0f} "
            f"{ours / full:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
