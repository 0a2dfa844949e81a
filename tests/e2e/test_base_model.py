"""`streamrl up` on a base model (no chat template in its tokenizer): it trains with
`model.chat_template`, and without one the run stops at once naming that field."""

from pathlib import Path

import pytest

from streamrl.chat.tiny_tokenizer import CHAT_TEMPLATE
from tests.e2e.test_up import assert_nothing_left, summary_of, up
from tests.integration.test_base_model import make_base_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("base")
    return make_base_checkpoint(root / "ckpt", root / "cache")


def _up(run_dir: Path, base: Path, *sets: str) -> tuple[int, str]:
    # The checkpoint's random weights as they are (no warm start): small and quick.
    proc = up(
        run_dir, 2, f'model.checkpoint="{base}"', 'model.init="checkpoint"',
        "rollout.num_generations=2", "rollout.max_turn_tokens=16", "trainer.groups_per_step=2",
        "rollout.max_concurrency=8",  # 4 groups of 2 in flight: 2 steps' worth (streamrl.fit)
        *sets,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def test_base_model_trains_with_the_builtin_template(tmp_path: Path, base: Path) -> None:
    run_dir = tmp_path / "run"
    code, out = _up(run_dir, base, 'model.chat_template="chatml"')
    assert code == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 2 and s["trajectories"] >= 4
    assert all(c == 0 for c in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    assert_nothing_left(s)
    # The export chats as the run trained: it carries the template it was trained with.
    from transformers import AutoTokenizer

    export = AutoTokenizer.from_pretrained(run_dir / "export", local_files_only=True)
    assert export.chat_template == CHAT_TEMPLATE


def test_base_model_without_a_template_stops_at_once(tmp_path: Path, base: Path) -> None:
    run_dir = tmp_path / "run"
    code, out = _up(run_dir, base, "run.max_restarts=1000", "run.restart_backoff_s=0.5")
    assert code == 1, out
    assert "stopped with a fatal error" in out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 0 and sum(s["worker_restarts"].values()) == 0
    failed = [p for p in (run_dir / "logs").glob("*.stderr") if "ModelChatError" in p.read_text()]
    assert failed, out
    err = failed[0].read_text()
    assert "has no chat template" in err and "set model.chat_template" in err
    assert_nothing_left(s)
