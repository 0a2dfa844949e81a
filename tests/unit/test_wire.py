from typing import get_args

import msgspec
import numpy as np
import pytest

from streamrl.wire import (
    EPISODE_STATE_VERSION,
    SCHEMA_VERSION,
    DeadLetter,
    EpisodeState,
    Group,
    Message,
    SavedTurn,
    Status,
    Task,
    TrainMetrics,
    Trajectory,
    Weights,
    WireError,
    decode,
    decode_body,
    decode_state,
    encode,
    encode_state,
    pack_arrays,
)


def _traj(member: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"g1:{member}",
        group_id="g1",
        task_id="t1",
        member=member,
        num_generations=2,
        **pack_arrays([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -1.25]),
        prompt_len=2,
        reward=1.0,
        status="ok",
        versions=[3, 4],
        num_tool_calls=1,
        timings={"episode_s": 0.5},
    )


MESSAGES: list[Message] = [
    Task(
        task_id="t1",
        group_id="g1",
        kind="arithmetic",
        prompt="Compute 1+2",
        answer="3",
        num_generations=4,
        cursor=7,
    ),
    _traj(),
    Group(group_id="g1", task_id="t1", members=[_traj(0), _traj(1)], advantages=[1.0, -1.0]),
    Weights(version=2, step=2, path="/x/v2.weights", nbytes=10, checksum="xxh3_128:" + "ab" * 16),
    DeadLetter(
        source="s",
        entry_id="1-0",
        reason="bad",
        fields={"data": b"\x00"},
        consumer="c",
        deliveries=3,
    ),
    TrainMetrics(
        step=1,
        version=1,
        loss=0.5,
        reward_mean=0.25,
        num_groups=2,
        num_sequences=8,
        num_tokens=100,
        clip_fraction=0.0,
        grad_norm=1.0,
        max_policy_lag=1,
        step_time_s=0.1,
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    fields = encode(msg)
    assert fields["v"] == str(SCHEMA_VERSION).encode()
    # Redis hands back bytes keys; decoding accepts those.
    as_redis = {k.encode(): v for k, v in fields.items()}
    assert decode(as_redis, type(msg)) == msg


def test_trajectory_arrays() -> None:
    t = _traj()
    assert t.token_array().tolist() == [5, 6, 7, 8]
    assert t.mask_array().tolist() == [0, 0, 1, 1]
    np.testing.assert_allclose(t.logprob_array(), [0.0, 0.0, -0.5, -1.25])
    assert (t.min_version, t.max_version) == (3, 4)


def test_members_ended_by_infrastructure_are_not_valid() -> None:
    # error (a tool or engine failure) and timeout (the episode's wall clock) are masked out
    # of the group's statistics and the loss; truncated is the policy's own doing
    valid = {st: msgspec.structs.replace(_traj(), status=st).valid for st in get_args(Status)}
    assert valid == {"ok": True, "truncated": True, "error": False, "timeout": False}


def test_pack_arrays_rejects_misaligned() -> None:
    with pytest.raises(ValueError, match="aligned"):
        pack_arrays([1, 2], [1], [0.0, 0.0])


def test_wrong_schema_version() -> None:
    fields = encode(MESSAGES[0])
    fields["v"] = b"99"
    with pytest.raises(WireError, match="schema version '99'"):
        decode(fields, Task)


def test_wrong_kind() -> None:
    with pytest.raises(WireError, match="'task' where 'trajectory'"):
        decode(encode(MESSAGES[0]), Trajectory)


def test_garbage_body() -> None:
    fields = encode(MESSAGES[0])
    fields["data"] = b"\xc1\xff garbage"
    with pytest.raises(WireError, match="cannot decode task body"):
        decode(fields, Task)


def test_missing_field_in_body() -> None:
    body = msgspec.msgpack.encode({"task_id": "t"})
    with pytest.raises(WireError, match="cannot decode task body"):
        decode({"v": b"1", "kind": b"task", "data": body}, Task)


def _state() -> EpisodeState:
    return EpisodeState(
        traj_id="g1-m0",
        **pack_arrays([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 0], [0, 0, -0.5, -1.25, 0, 0]),
        prompt_len=2,
        versions=[3],
        turns=[SavedTurn(start=2, end=4, observations=["42", "error: no"], info={"n": 1.0})],
        env={"records": [["add", {"a": 1, "b": [2, 3]}, True, "5", ""]], "steps": 1},
        num_tool_calls=1,
        run_seed=7,
        model_s=0.25,
        env_s=1.5,
        elapsed_s=2.0,
        worker="rollout-0",
    )


def test_episode_state_round_trip() -> None:
    state = _state()
    back = decode_state(encode_state(state))
    assert back == state
    assert back.turn == 1 and back.schema == EPISODE_STATE_VERSION
    assert np.frombuffer(back.logprobs, "<f4")[3] == -1.25
    marker = EpisodeState(traj_id="g1-m1", committed=True)
    assert decode_state(encode_state(marker)) == marker
    assert len(encode_state(marker)) < len(encode_state(state))


def test_episode_state_refuses_other_schemas_and_garbage() -> None:
    other = msgspec.structs.replace(_state(), schema=EPISODE_STATE_VERSION + 1)
    with pytest.raises(WireError, match="episode state schema 2 != 1"):
        decode_state(encode_state(other))
    with pytest.raises(WireError, match="cannot decode episode state"):
        decode_state(b"\x93garbage")
    with pytest.raises(WireError, match="cannot decode episode state"):
        decode_state(msgspec.msgpack.encode({"schema": 1, "traj_id": 5}))


def test_train_metrics_written_before_the_mismatch_fields_decode() -> None:
    old = {
        "step": 3, "version": 3, "loss": 0.1, "reward_mean": 0.5, "num_groups": 1,
        "num_sequences": 4, "num_tokens": 9, "clip_fraction": 0.0, "grad_norm": 1.0,
        "max_policy_lag": 0, "step_time_s": 0.2, "created_at": 1.0,
    }  # fmt: skip
    m = decode_body(msgspec.msgpack.encode(old), TrainMetrics)
    assert (m.step, m.mismatch_kl, m.mismatch_logp_abs, m.correction_fraction) == (3, 0, 0, 0)
