"""The tool ledger's idempotency key and the config naming its tools."""

from streamrl.config import parse_config
from streamrl.tools.ledger import ledger_key

CALL = "g7-m1-3-0"


def test_same_call_same_key() -> None:
    a = ledger_key(CALL, "shell", '{"command": "echo hi"}')
    assert a == ledger_key(CALL, "shell", '{"command": "echo hi"}')
    assert a.startswith(f"{CALL}#") and len(a) == len(CALL) + 1 + 12


def test_whitespace_and_key_order_do_not_make_another_call() -> None:
    a = ledger_key(CALL, "send", '{"to": "x", "body": "hi"}')
    assert a == ledger_key(CALL, "send", '{"body":"hi","to":"x"}')
    # parsed arguments (an in-process tool) key the same as their JSON text
    assert a == ledger_key(CALL, "send", {"body": "hi", "to": "x"})


def test_different_call_different_key() -> None:
    a = ledger_key(CALL, "shell", '{"command": "echo hi"}')
    assert a != ledger_key(CALL, "shell", '{"command": "echo ho"}')  # other arguments
    assert a != ledger_key(CALL, "python", '{"command": "echo hi"}')  # other tool
    assert a != ledger_key("g7-m1-3-1", "shell", '{"command": "echo hi"}')  # other call
    # text that is no JSON is keyed as it is
    assert ledger_key(CALL, "shell", "{bad") != ledger_key(CALL, "shell", "{bad ")


def test_non_idempotent_parses() -> None:
    # The names are checked against the tools (built-in and tools.extra) when a worker
    # starts: streamrl.tools.registry.load_tools, tested in tests/unit/test_plugins.py.
    cfg = parse_config({"tools": {"non_idempotent": ["shell"]}})
    assert cfg.tools.non_idempotent == ["shell"]
