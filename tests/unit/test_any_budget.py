"""Issue 27 item 5: uses of `Any` in packages/ and workers/ at most half of the 373 the code
review counted at 7687053. The first typing pass brought them to 178 and they crept back to
239 as code was added; the second brought them to 45 (JSON aliases in `streamrl.jsontypes`,
TypedDicts for the endpoint's and the evaluator's documents, typed Redis replies). The
ceiling is a ratchet: lower it when the count falls, and type new code rather than raise it.

Counted as the review and the closing notes count: each occurrence of the word `Any` on a
line of a .py file under packages/ or workers/ that is not an import line (comments
included)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ISSUE_BOUND = 373 // 2  # the issue's: half of the review's count
CEILING = 60  # the ratchet (45 when it was set)
WORD = re.compile(r"\bAny\b")


def count_any(text: str) -> int:
    return sum(len(WORD.findall(line)) for line in text.splitlines() if "import" not in line)


def any_uses() -> Counter[str]:
    uses: Counter[str] = Counter()
    for root in ("packages", "workers"):
        for path in sorted((REPO / root).rglob("*.py")):
            n = count_any(path.read_text())
            if n:
                uses[str(path.relative_to(REPO))] = n
    return uses


def test_the_count_reads_words_not_imports() -> None:
    text = (
        "from typing import Any\n"
        "def f(x: dict[str, Any]) -> Any: ...  # Any here counts\n"
        "AnyStr = 1; Anything = 2\n"
    )
    assert count_any(text) == 3


def test_uses_of_any_stay_under_the_ratchet() -> None:
    assert CEILING <= ISSUE_BOUND
    uses = any_uses()
    assert sum(uses.values()) <= CEILING, uses.most_common(12)
