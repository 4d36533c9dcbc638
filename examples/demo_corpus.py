"""Real text that every machine with Python already has, for the demo: no download.

- The *domain* corpus is the documentation of the Python standard library, read from its source
  with `ast` (nothing is imported): one document per module, in the layout `pydoc` prints (the
  module's docstring, then each class, function and method with its signature and docstring).
- The *general* corpus is what installed packages ship as prose: their long descriptions
  (README files, from `METADATA`) and their license texts.

Both are split into train and held-out parts by *group* (a top-level module or package, a
distribution), never by block, and every held-out entry that shares more than
`MAX_SHARED_SHINGLES` of its 8-word shingles with the training text is dropped: the held-out
text is not a near-copy of anything trained on.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# Standard-library folders that are tests, demos, GUI tooling or vendored copies, not documentation.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "lib2to3",
                          "ensurepip", "turtledemo", "tkinter", "__pycache__", "__phello__"})
SHINGLE = 8
MAX_SHARED_SHINGLES = 0.3


@dataclass(frozen=True)
class Document:
    """One document: a module's documentation or one package's texts, as a list of entries."""

    group: str
    entries: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(self.entries)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return f"({ast.unparse(node.args)})"
    except (ValueError, AttributeError):
        return "(...)"


def _entries(tree: ast.Module, module: str) -> Iterator[str]:
    doc = ast.get_docstring(tree)
    if doc:
        yield f"Module {module}\n\n{doc}"

    def members(body: list[ast.stmt], prefix: str, depth: int) -> Iterator[str]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name.startswith("_") and node.name != "__init__":
                    continue
                doc = ast.get_docstring(node)
                if isinstance(node, ast.ClassDef):
                    bases = ", ".join(ast.unparse(b) for b in node.bases)
                    head = f"class {prefix}{node.name}({bases})" if bases else f"class {prefix}{node.name}"
                    if doc:
                        yield f"{head}\n    " + doc.replace("\n", "\n    ")
                    if depth == 0:
                        yield from members(node.body, f"{prefix}{node.name}.", depth + 1)
                elif doc:
                    yield f"{prefix}{node.name}{_signature(node)}\n    " + doc.replace("\n", "\n    ")

    yield from members(tree.body, f"{module}.", 0)


def stdlib_documents(root: str | None = None) -> list[Document]:
    """The standard library's documentation, one `Document` per public module, in a stable order.

    Example:
        >>> docs = stdlib_documents()
        >>> any(d.entries[0].startswith("Module json") for d in docs)
        True
    """
    root = root or sysconfig.get_paths()["stdlib"]
    documents: list[Document] = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("_"))
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("_") and name != "__init__.py":
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = ".".join(parts)
            entries = tuple(_entries(tree, module))
            if entries:
                documents.append(Document(group=parts[0], entries=entries))
    return documents


def package_documents() -> list[Document]:
    """Prose shipped by the installed distributions: long descriptions and license files.

    Example:
        >>> docs = package_documents()
        >>> all(d.entries for d in docs)
        True
    """
    documents: list[Document] = []
    seen: set[str] = set()
    dists = sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    for dist in dists:
        name = (dist.metadata["Name"] or "").lower()
        if not name or name in seen:
            continue
        seen.add(name)
        texts: list[str] = []
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if description.strip():
            texts.append(description.strip())
        for file in dist.files or ():
            if re.search(r"(LICEN[CS]E|COPYING|NOTICE|AUTHORS)[^/]*$", str(file), re.IGNORECASE):
                try:
                    text = file.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if text and text.strip():
                    texts.append(text.strip())
        paragraphs = tuple(p.strip() for t in texts for p in re.split(r"\n\s*\n", t) if p.strip())
        if paragraphs:
            documents.append(Document(group=name, entries=paragraphs))
    return documents


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(text: str) -> set[int]:
    words = _words(text)
    return {hash(" ".join(words[i : i + SHINGLE])) for i in range(max(0, len(words) - SHINGLE + 1))}


def _held_out_groups(documents: list[Document], percent: float) -> set[str]:
    """Groups in a fixed pseudo-random order (a hash of the name), taken until they hold `percent` of the text."""
    sizes: dict[str, int] = {}
    for doc in documents:
        sizes[doc.group] = sizes.get(doc.group, 0) + len(doc.text)
    order = sorted(sizes, key=lambda g: hashlib.sha256(g.encode()).hexdigest())
    target, held, total = sum(sizes.values()) * percent / 100, set(), 0
    for group in order:
        if total >= target:
            break
        if total + sizes[group] <= 2 * target:  # skip a group larger than the whole held-out share
            held.add(group)
            total += sizes[group]
    return held


def split_documents(documents: Iterable[Document], held_out_percent: float) -> tuple[list[Document], list[Document], dict[str, int]]:
    """Split by group, drop exact repeats, and remove near-copies of training text from the held-out part.

    Returns the training documents, the held-out documents and counts (entries kept, dropped).

    Example:
        >>> a = Document("a", ("one two three four five six seven eight nine",))
        >>> b = Document("b", ("one two three four five six seven eight nine ten",))
        >>> train, held, counts = split_documents([a, b], held_out_percent=50.0)
        >>> counts["near_copies_dropped"], len(held)
        (1, 0)
    """
    seen: set[str] = set()
    unique: list[Document] = []
    repeats = 0
    for doc in documents:
        entries = []
        for entry in doc.entries:
            key = " ".join(_words(entry))
            if key in seen:
                repeats += 1
                continue
            seen.add(key)
            entries.append(entry)
        if entries:
            unique.append(Document(doc.group, tuple(entries)))
    held_groups = _held_out_groups(unique, held_out_percent)
    train = [d for d in unique if d.group not in held_groups]
    trained: set[int] = set()
    for doc in train:
        for entry in doc.entries:
            trained |= _shingles(entry)
    held: list[Document] = []
    dropped = 0
    for doc in (d for d in unique if d.group in held_groups):
        entries = []
        for entry in doc.entries:
            shingles = _shingles(entry)
            if shingles and len(shingles & trained) / len(shingles) > MAX_SHARED_SHINGLES:
                dropped += 1
                continue
            entries.append(entry)
        if entries:
            held.append(Document(doc.group, tuple(entries)))
    counts = {"train_entries": sum(len(d.entries) for d in train), "held_out_entries": sum(len(d.entries) for d in held),
              "repeats_dropped": repeats, "near_copies_dropped": dropped}
    return train, held, counts


def shared_shingle_fraction(held_out: Iterable[Document], train: Iterable[Document]) -> float:
    """The largest share of one held-out entry's 8-word shingles that also occur in the training text."""
    trained: set[int] = set()
    for doc in train:
        for entry in doc.entries:
            trained |= _shingles(entry)
    worst = 0.0
    for doc in held_out:
        for entry in doc.entries:
            shingles = _shingles(entry)
            if shingles:
                worst = max(worst, len(shingles & trained) / len(shingles))
    return worst
