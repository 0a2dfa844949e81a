"""Learning really happens: the real engine samples, the grouper's advantages score, the real
train step updates, and a few hundred steps raise a fixed synthetic reward."""

import numpy as np

from streamrl.config import TrainerConfig
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.llm import init_params
from streamrl.model.sampling import GenRequest, SamplingParams
from streamrl.model.spec import ModelSpec
from streamrl.rl.advantages import ADVANTAGES
from streamrl.trainer.step import TrainStep, build_batch, init_state, make_optimizer

SPEC = ModelSpec.from_config(
    {
        "model_type": "qwen2", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64, "tie_word_embeddings": True,
    }
)  # fmt: skip
TARGET, GROUP, NEW = 7, 8, 8
PROMPT = [1, 2, 3, 4]


def reward(tokens: list[int]) -> float:
    """The share of sampled tokens that are TARGET: 1/15 for a uniform policy."""
    return sum(t == TARGET for t in tokens) / len(tokens)


def test_a_few_hundred_steps_raise_a_synthetic_reward() -> None:
    params = init_params(SPEC, seed=0, std=0.02)  # near-uniform start
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    engine = Engine(SPEC, params, EngineConfig(
        num_slots=GROUP, kv_cache_size=16, max_prompt_length=4, max_new_tokens=NEW,
        sampling=sampling, stop_ids=(), pad_id=0, decode_chunk=NEW,
    ))  # fmt: skip
    cfg = TrainerConfig(learning_rate=3e-3, loss="dapo", clip_epsilon_high=0.28)
    optimizer = make_optimizer(cfg)
    step = TrainStep(SPEC, cfg, 1.0, optimizer)
    state = init_state(params, optimizer)
    history = []
    for it in range(300):
        engine.set_params(state.params)
        results = engine.generate(
            [GenRequest(PROMPT, NEW, seed=it * GROUP + g) for g in range(GROUP)]
        )
        rewards = [reward(r.tokens) for r in results]
        history.append(float(np.mean(rewards)))
        advantages = ADVANTAGES["grpo"](rewards, 1e-6)
        items = [
            (
                np.asarray(PROMPT + r.tokens, np.int32),
                np.asarray([0] * len(PROMPT) + [1] * len(r.tokens), np.uint8),
                np.asarray([0.0] * len(PROMPT) + r.logprobs, np.float32),
            )
            for r in results
        ]
        state, metrics = step(state, build_batch(items, advantages, 0))
        assert np.isfinite(float(metrics["loss"]))
    first, last = np.mean(history[:5]), np.mean(history[-30:])
    assert first < 0.15, first  # about 1/15 at the start
    assert last > 0.6, (first, last)  # the policy learned to emit TARGET
    assert step.compile_count == 1
