"""`hf-zero <argv>` run in the test's own process: the same `main` the console script calls, without a new
interpreter's imports (5-7 s on 2 cores). One test per subcommand family still runs the entry point itself."""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    """Its exit code, stdout and stderr, as `subprocess.run(..., capture_output=True, text=True)` gives them."""
    from hf_zero.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())
