"""The differential fuzzer (tests/_fuzz.py): training programs under torch's DDP and under hf_zero at stages 1-3 on
2 or 3 gloo ranks, compared number by number; any silent difference is reported with the shrunk program that shows it.

    python benchmarks/fuzz.py --programs 1000 [--first-seed 0] [--out benchmarks/results/fuzz.md]

`make fuzz` runs it (FUZZ_PROGRAMS=N for more). The report lists the count, the seeds, the outcomes per stage
(exact, refused by name, fp32 noise confirmed exact in float64, silent) and every silent one with its program.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import _fuzz as fuzz  # noqa: E402
from tests._dist import Pools  # noqa: E402


def _kind(outcome: str) -> str:
    return outcome.split(":")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.md"))
    args = parser.parse_args()
    pools = Pools()
    counts: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()
    silent: list[fuzz.Finding] = []
    started = time.monotonic()
    seeds = range(args.first_seed, args.first_seed + args.programs)
    try:
        for i, seed in enumerate(seeds):
            finding = fuzz.check(pools, fuzz.draw(seed))
            for outcome in finding.outcomes.values():
                counts[_kind(outcome)] += 1
                if outcome.startswith("refused"):
                    refusals[outcome[:160]] += 1
            if finding.silent:
                silent.append(finding)
                print(f"seed {seed}: SILENT {finding.outcomes}\n  shrunk: {finding.shrunk}", flush=True)
            if (i + 1) % 50 == 0:
                print(f"{i + 1}/{args.programs} programs, {time.monotonic() - started:.0f} s: {dict(counts)}", flush=True)
    finally:
        pools.close()
    elapsed = time.monotonic() - started
    lines = [
        "# Differential fuzzer: hf_zero against torch DDP",
        "",
        f"{datetime.date.today().isoformat()}; `python benchmarks/fuzz.py --programs {args.programs} --first-seed "
        f"{args.first_seed}`; {platform.processor() or platform.machine()}, 2 or 3 gloo ranks on CPU; {elapsed / 60:.1f} "
        "minutes.",
        "",
        f"Seeds {seeds.start}-{seeds.stop - 1}: {args.programs} programs, each at stages 1, 2 and 3 beside DDP "
        f"({3 * args.programs} runs).",
        "",
        "| outcome | runs |",
        "|---|---|",
        *(f"| {kind} | {n} |" for kind, n in sorted(counts.items())),
        "",
        f"Silent divergences: **{len(silent)}**.",
        "",
    ]
    if refusals:
        lines += ["Refusals (by message):", ""] + [f"- {n} x `{m}`" for m, n in refusals.most_common()] + [""]
    for finding in silent:
        lines += [f"- seed {finding.program.seed}: {finding.outcomes}", f"  shrunk: `{finding.shrunk}`"]
    fuzz.write_report(Path(args.out), lines)
    print("\n".join(lines))
    return 1 if silent else 0


if __name__ == "__main__":
    raise SystemExit(main())
