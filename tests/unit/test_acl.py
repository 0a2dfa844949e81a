"""The ACL file, credentials and secrets handling of `streamrl.run.acl` (no server: the
integration test loads the file into real ones)."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.names import Keys
from streamrl.run import acl
from streamrl.run.launcher import Launcher
from streamrl.run.logs import configure_logging
from streamrl.run.runtime import PASSWORD_FILE_ENV, resolve_redis_url

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.toml"


def users(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines():
        _user, name, *rules = line.split()
        out[name] = rules
    return out


def test_default_off_and_no_password_in_the_file() -> None:
    passwords = acl.new_passwords()
    text = acl.render_acl(Keys("demo"), passwords, read_only_patterns=True)
    table = users(text)
    assert table["default"][0] == "off" and "-@all" in table["default"]
    assert set(table) == {"default", *acl.ROLES}
    for role, password in passwords.items():
        assert password not in text
        assert f"#{acl.password_hash(password)}" in table[role]


@pytest.mark.parametrize("read_only", [True, False])
def test_every_role_is_an_allow_list_without_admin(read_only: bool) -> None:
    table = users(acl.render_acl(Keys("demo"), acl.new_passwords(), read_only_patterns=read_only))
    for role in acl.ROLES:
        rules = table[role]
        assert rules[2:5] == ["resetkeys", "resetchannels", "-@all"], role
        assert "~*" not in rules and "+@all" not in rules and "allkeys" not in rules
        # no category after the denials brings a dangerous command back (commands named
        # after them are allowed, or denied one by one: review N18)
        after = rules[rules.index("-@admin") + 1 :]
        assert all(r[:1] in "+-" and r[1:2] != "@" for r in after), role
        if role != acl.OPERATOR:
            assert "-randomkey" in after
            assert ("-scan" in after) == (role not in ("trainer", "colocated"))
        assert not {"+config", "+flushall", "+acl", "+keys", "+script", "+debug"} & set(after)
        # the trainer declares every key it reads to the snapshot's EVAL: none read-only;
        # the colocated worker is a trainer too, and reads only what rollout reads of the
        # grouper's (the groups waiting, its backpressure); every other worker reads the
        # run's id (review N8)
        reads_only = role in ("feeder", "rollout", "tools", "grouper", "colocated", "sinks")
        read_only_rules = [r for r in rules if r.startswith("%R~")]
        assert bool(read_only_rules) == (read_only and reads_only), role
        if role == "colocated" and read_only:
            assert read_only_rules == [f"%R~{Keys('demo').groups_waiting}"]
        if role in ("feeder", "tools") and read_only:
            assert read_only_rules == [f"%R~{Keys('demo').run_id}"]
        if role == "sinks" and read_only:  # it writes nothing of the run (issue 32)
            k = Keys("demo")
            assert read_only_rules == [f"%R~{k.metrics}", f"%R~{k.stats}", f"%R~{k.run_id}"]


def test_patterns_follow_the_key_names() -> None:
    """The hash tag of every key (Redis Cluster) is in every pattern too."""
    rules = acl.render_acl(Keys("demo"), acl.new_passwords(), read_only_patterns=True)
    patterns = [r.split("~", 1)[1] for r in rules.split() if "~" in r]
    assert patterns and all(p.startswith("{demo}:") or p == acl.RQ_KEYS for p in patterns)


def test_only_rq_speakers_get_rq_keys() -> None:
    table = acl.roles(Keys("demo"))
    with_rq = {name for name, role in table.items() if acl.RQ_KEYS in role.keys}
    assert with_rq == {"rollout", "tools", "colocated"}
    assert table["tools"].channels == (acl.RQ_CHANNELS,)
    assert Keys("demo").groups not in table["tools"].keys + table["rollout"].keys


def test_credentials_are_private(tmp_path: Path) -> None:
    paths = acl.write_credentials(tmp_path / "secrets", {"feeder": "pw1", "operator": "pw2"})
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700
    for path in paths.values():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert acl.read_password_file(paths["feeder"]) == "pw1"
    again = acl.load_or_create_passwords(tmp_path / "secrets")
    assert again["feeder"] == "pw1" and set(again) == set(acl.ROLES)


def test_password_in_the_config_url_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides=["redis.url=redis://:hunter2@10.0.0.1:6379/0"])
    assert "REDIS_URL" in str(err.value) and "redis.password_file" in str(err.value)
    assert "hunter2" not in str(err.value)
    assert load_config(TINY, overrides=["redis.url=redis://tools@10.0.0.1:6379/0"])


def test_password_file_joins_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pw").write_text("p@ss:word\n")
    monkeypatch.setenv("REDIS_URL", "redis://tools@10.0.0.1:6379/0")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "pw"))
    cfg = load_config(TINY)
    assert resolve_redis_url(cfg) == "redis://tools:p%40ss%3Aword@10.0.0.1:6379/0"
    monkeypatch.delenv(PASSWORD_FILE_ENV)
    assert resolve_redis_url(cfg) == "redis://tools@10.0.0.1:6379/0"


def test_run_directory_is_owner_only(tmp_path: Path) -> None:
    """Review L9: the AOF, logs and checkpoints were created under the umask."""
    cfg = load_config(TINY)
    launcher = Launcher(cfg, str(TINY), [], tmp_path / "runs" / "new", steps=1)
    launcher._prepare_dir()
    assert stat.S_IMODE((tmp_path / "runs" / "new").stat().st_mode) == 0o700


def test_nested_secrets_are_redacted() -> None:
    """Review L12: only top-level fields were masked."""
    out = io.StringIO()
    log = configure_logging("tools", stream=out)
    log.info("skipped", skipped={"docker": {"url": "tcp://u:s3cret@h:1", "password": "pw9"}},
             urls=["redis://:hunter2@h:1/0"], tokens=3)  # fmt: skip
    line = out.getvalue()
    assert "s3cret" not in line and "pw9" not in line and "hunter2" not in line
    assert json.loads(line)["tokens"] == 3
