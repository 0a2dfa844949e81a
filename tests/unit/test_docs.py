"""The documentation site: the configuration reference is the schema's, the strict build
fails on a broken anchor, and the README's links land on pages and anchors that exist.

`make test` builds the site itself (ops/make_test.sh, `mkdocs build --strict`); these tests
check what that build cannot: that docs/config.md is what the schema gives now, and that
the build's settings catch what they are meant to.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops.docs import config_reference
from streamrl.config import Config

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "config.md"


def rows(text: str) -> dict[str, list[str]]:
    """The reference's table rows by field name (`rollout.temperature`), cells stripped."""
    found = {}
    for line in text.splitlines():
        m = re.match(r'\| <a id="([a-z_]+\.[a-z_0-9]+)"></a>', line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            found[m.group(1)] = cells
    return found


def test_config_reference_is_current() -> None:
    # Fails after a change to packages/streamrl/config.py that was not followed by
    # `python -m ops.docs.config_reference` (which rewrites docs/config.md).
    assert PAGE.read_text() == config_reference.render(), (
        "docs/config.md differs from the schema: run `python -m ops.docs.config_reference`"
    )


def test_every_field_has_a_row() -> None:
    sections = {s: f for s, f in Config.model_fields.items() if s != "tasks"}
    expected = {
        f"{section}.{name}"
        for section, field in sections.items()
        for name in field.annotation.model_fields  # type: ignore[union-attr]
    }
    page = config_reference.render()
    assert set(rows(page)) == expected
    # [[tasks]], a list of [task] tables, has a section of its own pointing there
    assert "## [[tasks]]\n" in page and "takes the fields of `[task]` above" in page


def test_known_fields_by_hand() -> None:
    table = rows(config_reference.render())
    # name, type, default, bounds, description
    assert table["rollout.temperature"][1:] == [
        "`float`",
        "`1.0`",
        "0 < x ≤ 10",
        "Sampling temperature.",
    ]
    # "auto" accepted through a validator and the default it stands for
    assert table["trainer.groups_per_step"][1:4] == [
        '`"auto"` or `int`',
        '`"auto"`',
        "0 ≤ x ≤ 65536",
    ]
    # a Literal's choices, and a field whose default is to be left out
    assert table["rollout.sync_mode"][1] == 'one of `"continue"`, `"finish"`, `"pause"`'
    assert table["model.seed"][1:4] == ["`int`", "*unset*", "0 ≤ x ≤ 2147483647"]
    assert table["run.name"][3] == "pattern `^[A-Za-z0-9_.-]{1,64}$`"
    assert table["task.agent_command"][1:4] == ["`list[str]`", "`[]`", "length ≤ 256"]


def test_description_markup_is_escaped() -> None:
    # Outside code spans, < > [ ] | * would be HTML, links, cell ends or emphasis.
    assert config_reference._prose("x <y> [a](b) | *z* `a<b>` W&B &lt;") == (
        r"x &lt;y&gt; \[a\](b) \| \*z\* `a<b>` W&B &amp;lt;"
    )
    # A code span holding | : an HTML code element of character references, which neither
    # GitHub (which splits a cell at a bare |) nor mkdocs (which shows a \|) misreads.
    assert config_reference._prose("`^$|^a*`") == "<code>^$&#124;^a&#42;</code>"


def test_check_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "config.md"
    stale.write_text(config_reference.render().replace("Sampling temperature.", "Old text."))
    assert config_reference.main(["--check", "--out", str(stale)]) == 1
    assert "run `python -m ops.docs.config_reference`" in capsys.readouterr().err
    assert config_reference.main(["--out", str(stale)]) == 0
    assert config_reference.main(["--check", "--out", str(stale)]) == 0


def build(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(root / "site")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built strictly from a copy of mkdocs.yml and docs/."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copy(REPO / "mkdocs.yml", root)
    shutil.copytree(REPO / "docs", root / "docs")
    result = build(root)
    assert result.returncode == 0, result.stderr
    return root / "site"


def test_strict_build_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    with (tmp_path / "docs" / "index.md").open("a") as f:
        f.write("\n[a section that is not there](guarantees.md#no-such-section)\n")
    result = build(tmp_path)
    assert result.returncode != 0
    assert "does not contain an anchor '#no-such-section'" in result.stderr


def test_readme_links_land(site: Path) -> None:
    """Every link of README.md into docs/ names a page of the site, and its anchor (if any)
    is an id on that page (GitHub renders the README; mkdocs never sees it)."""
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", (REPO / "README.md").read_text())
    assert links, "README.md links into no page of docs/"
    for path, anchor in links:
        assert (REPO / path).exists(), f"README.md links {path}, which does not exist"
        html = site / Path(path).relative_to("docs").with_suffix(".html")
        assert html.exists(), f"README.md links {path}, which the site does not build"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"README.md links {path}#{anchor}"
