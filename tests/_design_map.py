"""The file map of docs/design.md, generated from each module's docstring (its first sentence), between the
markers `<!-- file map -->` and `<!-- end of file map -->`. `python -m tests._design_map --write` rewrites it;
tests/test_code_notes.py checks it is current, so every file of the package is on the map with what it says of
itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- file map -->", "<!-- end of file map -->"
WIDTH = 118


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    end = first.find(". ")
    return (first[: end + 1] if end >= 0 else first) or "(no docstring)"


def generate() -> str:
    """The map: one line (wrapped) per module of `hf_zero/`, folders in order, each with its first sentence."""
    package = ROOT / "hf_zero"
    lines = ["```text"]
    for path in sorted(package.rglob("*.py"), key=lambda p: (p.parent.relative_to(package).parts, p.name)):
        name = str(path.relative_to(ROOT))
        text = f"{name:<44}{_summary(path)}"
        while len(text) > WIDTH:
            cut = text.rfind(" ", 0, WIDTH)
            lines.append(text[:cut])
            text = " " * 44 + text[cut + 1 :]
        lines.append(text)
    lines.append("```")
    return "\n".join(lines)


def current() -> str:
    """The map as docs/design.md holds it now."""
    text = DESIGN.read_text()
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write() -> None:
    text = DESIGN.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DESIGN.write_text(f"{head}{BEGIN}\n{generate()}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    print(generate())
