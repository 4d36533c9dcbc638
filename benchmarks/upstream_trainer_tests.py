"""transformers' own Trainer tests, run twice: with the stock classes, and with `ZeroTrainer` /
`ZeroTrainingArguments` (`--zero_stage 3`, one process) in their place; which tests pass with one and not the other.

    python benchmarks/upstream_trainer_tests.py --tests ~/src/transformers/tests \\
        --files trainer/test_trainer_checkpointing.py trainer/test_trainer_resume.py \\
                trainer/test_trainer_optimizers.py trainer/test_gradient_clipping.py trainer/test_loss_reduction.py \\
        --out benchmarks/results

`--tests` is the `tests/` folder of a transformers checkout of the installed version (its sdist on PyPI ships no
tests; clone the tag). The swap is a pytest plugin (`benchmarks/_zero_swap.py`, loaded with `-p`): before any test
module is imported it puts `ZeroTrainer` and `ZeroTrainingArguments` (whose `zero_stage` defaults to 3) where
`from transformers import Trainer, TrainingArguments` finds them, so the files run unchanged. Each run writes a
JUnit XML; the report lists, per file, the tests that pass with the stock classes, those that also pass with
hf_zero's, and each one that does not, with the first line of its failure. Tests that need a network (a hub model)
fail in both runs and are counted apart.
Writes `<out>/upstream_trainer_tests.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_pytest(tests: Path, files: list[str], swap: bool, xml: Path, timeout_s: int) -> None:
    """One pytest run of `files` (relative to `tests`), with or without the swap plugin, results in `xml`."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "--rootdir", str(tests)]
    if swap:
        cmd += ["-p", "_zero_swap"]
    cmd += [str(tests / f) for f in files]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    subprocess.run(cmd, cwd=tests.parent, env=env, timeout=timeout_s, check=False)


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """`{file::Class::test: (outcome, first line of the message)}` from a JUnit XML file."""
    result: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or "").splitlines()[0][:200] if node.get("message") else ""
                break
        result[name] = (outcome, message)
    return result


def compare(stock: dict[str, tuple[str, str]], zero: dict[str, tuple[str, str]]) -> dict[str, object]:
    """What passes with the stock classes, what of that passes with hf_zero's, and each difference."""
    passing = sorted(n for n, (o, _) in stock.items() if o == "passed")
    lost = {}
    for name in passing:
        outcome, message = zero.get(name, ("missing", ""))
        if outcome != "passed":
            lost[name] = message or outcome
    network = sorted(
        n for n, (o, m) in stock.items() if o == "failed" and ("hub" in m.lower() or "offline" in m.lower())
    )
    return {
        "stock_passed": len(passing),
        "zero_passed_of_those": len(passing) - len(lost),
        "not_passing_with_zero": lost,
        "failing_with_stock": sorted(n for n, (o, _) in stock.items() if o == "failed"),
        "network_in_stock": network,
    }


def report(summary: dict[str, object], files: list[str]) -> str:
    lines = [
        "# transformers' Trainer tests with ZeroTrainer (`--zero_stage 3`, one process)",
        "",
        f"Files: {', '.join(f'`{f}`' for f in files)}.",
        "",
        f"Passing with the stock Trainer: **{summary['stock_passed']}**; of those, passing with ZeroTrainer: "
        f"**{summary['zero_passed_of_those']}**.",
        "",
    ]
    lost = summary["not_passing_with_zero"]
    if isinstance(lost, dict) and lost:
        lines += ["| test | with ZeroTrainer |", "|---|---|"]
        lines += [f"| `{name}` | {message} |" for name, message in sorted(lost.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", type=Path, required=True, help="the tests/ folder of a transformers checkout")
    ap.add_argument("--files", nargs="+", required=True, help="test files, relative to --tests")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--timeout-s", type=int, default=3600)
    args = ap.parse_args()
    missing = [f for f in args.files if not (args.tests / f).is_file()]
    if missing:
        raise SystemExit(f"no such test file under {args.tests}: {missing}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for swap in (False, True):
            xml = Path(tmp) / f"{'zero' if swap else 'stock'}.xml"
            run_pytest(args.tests, args.files, swap, xml, args.timeout_s)
            runs[swap] = outcomes(xml)
    summary = compare(runs[False], runs[True])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "upstream_trainer_tests.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = report(summary, args.files)
    (args.out / "upstream_trainer_tests.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
