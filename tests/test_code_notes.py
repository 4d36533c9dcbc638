"""The engine's `[Note: X]` blocks: every pointer `[Note: X] in FILE` names the file that holds the note (a
stale pointer sends a reader to a file without it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a note is defined where its title `[Note: X]` stands alone on a line (after `#` or a docstring's quotes), or, for a
# note with no such line anywhere, where the title opens a line and is not a pointer (`[Note: X] in FILE`)
TITLE = re.compile(r'^[ \t]*(?:"""|#)?[ \t]*\[Note: ([^\]]+)\][ \t]*$', flags=re.M)
DEFINED = re.compile(r'^[ \t]*(?:"""|#)?[ \t]*\[Note: ([^\]]+)\](?!\s+in\s)', flags=re.M)
POINTER = re.compile(r"\[Note: ([^\]]+)\] in\s+`?([\w/.]+\.py)")


def _name(text: str) -> str:
    return " ".join(text.replace("#", " ").split())


def test_every_note_pointer_names_the_file_that_holds_the_note():
    files = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "hf_zero").rglob("*.py")}
    titled: dict[str, set[str]] = {}
    opened: dict[str, set[str]] = {}
    for path, text in files.items():
        for m in TITLE.finditer(text):
            titled.setdefault(_name(m.group(1)), set()).add(path)
        for m in DEFINED.finditer(text):
            opened.setdefault(_name(m.group(1)), set()).add(path)
    holders = {**opened, **titled}
    stale = []
    for path, text in files.items():
        for m in POINTER.finditer(text):
            note, target = _name(m.group(1)), m.group(2)
            if not any(h == target or h.endswith("/" + target) for h in holders.get(note, ())):
                stale.append(f"{path}: [Note: {note}] in {target}; the note is in {sorted(holders.get(note, ())) or 'no file'}")
    assert not stale, "\n".join(stale)
    assert len(holders) > 100  # the pattern still finds the notes


def test_the_design_map_lists_every_file_with_its_docstring():
    """docs/design.md's file map is what `python -m tests._design_map --write` generates from the module docstrings
    now: every file of the package on it, each with what its own docstring says (`make design-map` rewrites it)."""
    from tests import _design_map

    assert _design_map.current() == _design_map.generate(), "docs/design.md's file map is stale: make design-map"
    listed = {line.split()[0] for line in _design_map.current().splitlines() if line.startswith("hf_zero/")}
    assert listed == {str(p.relative_to(ROOT)) for p in (ROOT / "hf_zero").rglob("*.py")}
    assert "(no docstring)" not in _design_map.current()


def test_no_import_cycle_of_any_kind():
    """No two modules of hf_zero import each other through any path, counting imports under `TYPE_CHECKING` and
    deferred ones inside functions (they hide a cycle from the runtime, not from the design)."""
    from tests._import_graph import cycles, edges

    assert len(edges()) > 80
    assert cycles() == []


def test_checkpoints_and_integrations_reach_the_engine_through_its_facade():
    """[Note: engine facade] in hf_zero/engine/facade.py: nothing under checkpoint/, integrations/ or features/
    takes the engine itself (`get_engine`, `ZeroEngine`) or reaches into its plan, hooks, loss scaler, disk store or
    call-order record; they use `facade_of(model)`."""
    reach = re.compile(r"\bget_engine\b|\bZeroEngine\b|engine\.engine\b|(?<![.\w])_?engine\.(plan|hooks|scaler|disk|calls)\b")
    found = []
    for folder in ("checkpoint", "integrations", "features"):
        for path in sorted((ROOT / "hf_zero" / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if reach.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    users = [p for f in ("checkpoint", "integrations") for p in (ROOT / "hf_zero" / f).rglob("*.py")]
    assert sum("facade_of" in p.read_text() or "EngineFacade" in p.read_text() for p in users) >= 8


# each layer of the package, and what it may import besides itself: the settings below everything, then the engine,
# then what is built on it (checkpoints, model features); above them the public API, the model's mixin and the
# integrations with transformers and Accelerate (unlisted: they may import any layer below)
SETTINGS = {"config", "dtypes", "launch"}
LAYERS = {"engine": SETTINGS, "checkpoint": SETTINGS | {"engine"}, "features": SETTINGS | {"engine"}}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package)"


def test_the_layers_import_only_what_is_below_them():
    """engine/ imports only the settings (config, dtypes, launch); checkpoint/ and features/ only the engine and the
    settings: none reaches up to the public API, the model's mixin or integrations/, which only the package's root
    imports from outside it; counting every import, as the cycle check does."""
    from tests._import_graph import edges

    up = []
    for module, targets in edges().items():
        layer = _layer(module)
        for target in targets:
            other = _layer(target)
            if other == layer:
                continue
            if layer in LAYERS and other not in LAYERS[layer]:
                up.append(f"{module} -> {target}")
            if other == "integrations" and layer != "(package)":
                up.append(f"{module} -> {target}")
    assert not up, "\n".join(sorted(set(up)))

