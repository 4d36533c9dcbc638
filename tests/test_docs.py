"""The documentation: the site builds with warnings as errors (mkdocs, strict), the API reference lists every public
name, and every relative link of README.md and docs/ names a file of this checkout (and, into a Markdown page, one
of its headings)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_zero

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc both make it for plain headings."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", body, flags=re.M)}


def test_every_relative_link_names_a_file_and_heading_of_the_checkout():
    broken = []
    for page in PAGES:
        body = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(body):
            if re.match(r"^[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue  # another site
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_api_reference_lists_every_public_name():
    listed = {line.split()[-1].rsplit(".", 1)[-1] for line in (ROOT / "docs" / "api.md").read_text().splitlines()
              if line.startswith(":::")}
    assert set(hf_zero.__all__) <= listed, set(hf_zero.__all__) - listed  # and the types of hf_zero.types


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is not installed: `pip install -e '.[dev]'` installs it (mkdocs-material, mkdocstrings)")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                             "PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in hf_zero.__all__:
        assert name in api, name


# Phrases of a changelog or of one machine's session, not of a page that says what the library does: "Before: ..."
# (what a fix replaced), "silently; now ..." (a story of a fix), "this CPU" / "this machine" / "this VM" (whose?).
HISTORY = re.compile(r"\bBefore[:,] |; before, |\(before[:,] |here before|\bthis (?:CPU|VM|machine)\b|\bis now refused\b|\b\w+th session\b")


def test_user_pages_say_what_is_not_what_was():
    """README.md and docs/: what each behaviour is, with the measuring machine named beside a figure, not the history
    of a fix or "this machine" (the reader's is another)."""
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) for m in HISTORY.finditer(line)]
    assert not found, "\n".join(found)


def test_the_command_line_page_lists_every_subcommand():
    """docs/cli.md has a row for each `hf-zero` subcommand the parser knows (a new one cannot go unlisted)."""
    import argparse

    from hf_zero.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    page = (ROOT / "docs" / "cli.md").read_text()
    missing = [name for name in sub.choices if not re.search(rf"^\| `hf-zero {re.escape(name)}[ `]", page, re.M)]
    assert not missing, missing
