"""The GPU check (`benchmarks/gpu_check.py`) rehearsed on the CPU: the phases the lent GPU runs, here, from no index.

The rehearsal runs every phase but the user-path example (tests/test_examples.py runs that script the same way
on the CPU) and the profile at the tiny size (the peers phase on 3 of its scenarios), with pip allowed no index, and a wheel folder holding one wheel made here; the
report must show every case passed, each phase and the whole within their budgets (under 2 minutes). The
orchestration's own guarantees (a failing phase does not stop the next; a phase over its time is killed with its
children; the report is written after every phase) are checked on stand-in commands.
"""

from __future__ import annotations

import pytest

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, name: str = "hfzero_probe", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel (one module), written by hand: no build backend, no index."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": b"VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hf_zero-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


@pytest.mark.slow  # `make gpu-rehearse` runs the same; the phases' own tests stay in the fast tier
def test_rehearsal_runs_every_phase_from_no_index_within_budget(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels)
    out = tmp_path / "out"
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OUT"):
        env.pop(var, None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--size", "tiny", "--skip", "example,profile",
                           "--wheels", str(wheels), "--out", str(out)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=360)
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == ["wheels", "env", "single", "multi", "trainer", "speed", "peers", "io", "qlora",
                            "rank_of_n", "compiled"]
    assert report["installed"] == ["hfzero_probe-1.0.dist-info"]  # installed from the folder, with no index
    for p in report["phases"]:
        assert p["ok"] and p["within_budget"], (p["name"], p["seconds"], p["budget"], p["tail"][-2000:])
    assert report["total_s"] <= report["budget_s"] < 220 and wall < 250
    assert report["env"]["hf_zero_from"].startswith(str(ROOT))  # this tree, through PYTHONPATH
    cases = {p: [c["name"] for c in phases[p]["cases"] if c["ok"]] for p in phases}
    assert len(cases["single"]) == 13 and len(cases["multi"]) == 11 and len(cases["trainer"]) == 1
    peers = {c["name"]: c["figures"] for c in phases["peers"]["cases"]}
    assert len(cases["peers"]) == len(peers) == 9  # 3 scenarios x stages 1-3, on the rehearsal's CPU
    assert all(f == {"refused": "ValueError"} if "cast_to_bf16" in name else f["weights_rel"] <= 1e-5
               for name, f in peers.items())
    multi = {c["name"]: c["figures"] for c in phases["multi"]["cases"]}
    sequence = [f for name, f in multi.items() if "sequence_parallel" in name]
    assert len(sequence) == 2 and all(f["first_norm_rel"] <= 1e-6 and f["loss_rel"] <= 1e-5 for f in sequence)
    liger = [f for name, f in multi.items() if "Liger" in name]  # the stand-in here; Liger's own kernels on a GPU
    assert len(liger) == 1 and liger[0]["liger"].startswith("Liger-like stand-in") and liger[0]["loss_rel"] <= 1e-5
    single = {c["name"]: c["figures"] for c in phases["single"]["cases"]}
    assert single["ZeRO-3 fp32 vs PyTorch"]["weights_rel"] <= 1e-5
    assert set(single["units check and call-order header: queued on the device without a host sync"]) == {
        "queued_s", "plain_s"}
    assert all(not c["error"] for p in phases.values() for c in p["cases"])
    speed = {c["name"]: c["figures"] for c in phases["speed"]["cases"]}
    assert {"PyTorch (autocast bf16)", "FSDP2 fully_shard (bf16)", "hf_zero ZeRO-3 (bf16)"} <= set(speed)
    assert all(speed[e]["tokens_per_s"] > 0 for e in speed if "tokens_per_s" in speed[e])
    compiled = {c["name"]: c["figures"] for c in phases["compiled"]["cases"]}  # aot_eager here; inductor on a GPU
    assert all(compiled[e]["compiled_layers"] == 2 and compiled[e]["backend"] == "aot_eager"
               and compiled[e]["frames"] >= 1 for e in speed
               if "tokens_per_s" in speed[e])
    assert all(compiled[e]["first_loss"] == speed[e]["first_loss"] for e in speed if "tokens_per_s" in speed[e])
    io = {c["name"]: c["figures"] for c in phases["io"]["cases"]}
    assert len(cases["io"]) == 2 and next(f for n, f in io.items() if "from_pretrained" in n)["weights_rel"] == 0.0
    qlora = {c["name"]: c["figures"] for c in phases["qlora"]["cases"]}  # stage 3 at the tiny size, and the load
    assert len(cases["qlora"]) == len(qlora) == 3 and all(max(f.values()) <= 1e-5 for f in qlora.values())
    rank = next(c["figures"] for c in phases["rank_of_n"]["cases"])  # one rank of 8 through the fake group
    assert len(cases["rank_of_n"]) == 1 and rank["peak_GiB"] > 0 and rank["step_s"] > 0
    markdown = (out / "report.md").read_text()
    assert "## speed, side by side" in markdown and "| hf_zero ZeRO-3 (bf16) |" in markdown
    assert "| hf_zero ZeRO-3 (bf16) + compiled |" in markdown


def test_a_failing_or_overlong_phase_is_reported_and_the_next_one_runs(tmp_path):
    gpu_check = _gpu_check()
    check = gpu_check.Check(mode="rehearsal (cpu)", size="tiny", budget=60, python=sys.executable, out=tmp_path)
    env = {**os.environ}
    gpu_check.BUDGETS["tiny"].update(failing=10, sleeping=2, passing=10)
    failing = gpu_check.run_phase(check, "failing", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                                  env)
    started = time.perf_counter()
    child = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "import time; time.sleep(60)"
    sleeping = gpu_check.run_phase(check, "sleeping", [sys.executable, "-c", child], env)
    assert time.perf_counter() - started < 20  # killed at its budget, its child with it (no pipe left open)
    passing = gpu_check.run_phase(check, "passing", [sys.executable, "-c", "print('fine')"], env)
    assert not failing.ok and "boom" in failing.tail
    assert not sleeping.ok and sleeping.timed_out and "killed after 2 s" in sleeping.tail
    assert passing.ok
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(p["name"], p["ok"]) for p in report["phases"]] == [("failing", False), ("sleeping", False),
                                                                ("passing", True)]
    markdown = (tmp_path / "report.md").read_text()
    assert "| sleeping | TIMED OUT |" in markdown and "## failing: output tail" in markdown
