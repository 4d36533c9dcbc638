"""The markdown table and the chart of a capacity run (benchmarks/capacity.py)."""

from __future__ import annotations

import json
from pathlib import Path

from _capacity_model import GIB, LABELS


def _rank_max(run: dict, key: str) -> float:
    return max(r[key] for r in run["ranks"])


def floor_bytes(params: int) -> float:
    """16 bytes per parameter / 2 ranks: fp32 master, two moments, fp32 gradient shard."""
    return 16 * params / 2


def estimated_bytes(layers: int, offload: str = "none", precision: str = "bf16", engine: str = "hf_zero3") -> int:
    """`hf-zero estimate`'s per-device total for stage 3 at this size (2 ranks, 1 x SEQ tokens)."""
    row = estimate_row(layers, offload, precision, engine)
    return row.device_total + (row.host_per_node // 2 if offload != "none" else 0)


def estimate_row(layers: int, offload: str, precision: str, engine: str):  # noqa: ANN201
    """The estimator's stage-3 row for this size; for the LoRA engines the adapter of `_capacity_qlora.LORA` with
    activation checkpointing, and for QLoRA the 4-bit base (`hf-zero estimate --qlora`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from _capacity_model import SEQ, hf_config
    from hf_zero.estimate import Workload, as_4bit, estimate

    config = hf_config(layers)
    lora = engine in ("hf_zero3_qlora", "hf_zero3_lora")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            from _capacity_qlora import LORA

            model = get_peft_model(model, LoraConfig(**LORA))
    scales = as_4bit(model) if engine == "hf_zero3_qlora" else 0
    rows = estimate(model, config, world_size=2,
                    workload=Workload(micro_batch=1, seq_len=SEQ, gradient_checkpointing=lora),
                    mixed_precision="bf16" if precision == "bf16" and not lora else "no", whole_state_bytes=scales,
                    stream_ordered=False)
    return next(r for r in rows if r.stage == 3 and r.offload == offload)


def compare_section(report: dict) -> list[str]:
    """In memory against `offload_dir` at one size: steps after the first, I/O, and the floor the disk sets."""
    import statistics

    ok = {r["engine"]: r for r in report["runs"] if r["ok"]}
    if not {"hf_zero3", "hf_zero3_disk"} <= set(ok):
        return []
    mem, disk = ok["hf_zero3"], ok["hf_zero3_disk"]

    def steps(r: dict) -> list[float]:
        return [max(x["step_s"][i] for x in r["ranks"]) for i in range(1, len(r["ranks"][0]["step_s"]))]

    def opt(r: dict) -> float:
        return statistics.median(max(x["optimizer_s"][i] for x in r["ranks"]) for i in range(1, n))

    def peak(r: dict) -> float:
        return max(x["train_peak_rss"] for x in r["ranks"]) / GIB

    n = len(disk["ranks"][0]["step_s"])
    m, d = statistics.median(steps(mem)), statistics.median(steps(disk))
    moved = sum(x["disk_read_bytes"] + x["disk_written_bytes"] for x in disk["ranks"]) / n  # both ranks, per step
    read = sum(x["disk_read_bytes"] for x in disk["ranks"]) / n
    bw = report["disk"]
    floor = read / 1e9 / bw["read_gb_s"] + (moved - read) / 1e9 / bw["write_gb_s"]
    rows = ["", f"## {mem['params'] / 1e9:.2f}B: in memory against `offload_dir`", "",
            "| | in memory | offload_dir | ratio |", "|---|---|---|---|",
            f"| peak resident memory per rank in training (GiB) | {peak(mem):.2f} | {peak(disk):.2f} | "
            f"{peak(disk) / peak(mem):.2f} |",
            f"| peak during the save (GiB) | {max(x['save_peak_rss'] for x in mem['ranks']) / GIB:.2f} | "
            f"{max(x['save_peak_rss'] for x in disk['ranks']) / GIB:.2f} | |",
            f"| step, median of steps 2-{n} (s) | {m:.2f} | {d:.2f} | {d / m:.2f} |",
            f"| optimizer step, median of steps 2-{n} (s) | {opt(mem):.2f} | {opt(disk):.2f} | {opt(disk) / opt(mem):.2f} |"]
    per_rank = disk["ranks"][0]
    rows += ["", f"Disk traffic per step, both ranks: {read / 1e9:.1f} GB read, {(moved - read) / 1e9:.1f} GB written. "
             f"At the measured {bw['read_gb_s']:.2f} GB/s read and {bw['write_gb_s']:.2f} GB/s write (uncached, "
             f"fsync'd), that is a floor of {floor:.1f} s per step if every byte met the disk; the I/O threads of "
             f"rank 0 spent {per_rank['disk_read_s'] / n:.1f} s reading and {per_rank['disk_write_s'] / n:.1f} s "
             f"writing per step (through the page cache), and the step waited {per_rank['disk_waited_s'] / n:.2f} s "
             "per step for them (the rest overlapped the optimizer's compute)."]
    return rows


RATIOS = [("hf_zero3", "fsdp2"), ("hf_zero3", "ddp"), ("hf_zero3", "ds3"), ("hf_zero3", "ds3_raw"),
          ("hf_zero3_disk", "hf_zero3"),
          ("hf_zero3_disk_params", "hf_zero3"), ("hf_zero3_disk_params", "ds3_nvme"),
          ("hf_zero3_disk", "ds3_nvme_lean"), ("hf_zero3_disk_params", "ds3_nvme_lean"),
          ("hf_zero3_qlora", "hf_zero3_lora"), ("hf_zero3_qlora", "fsdp_qlora"), ("hf_zero3_qlora", "ds3_qlora")]


def ratio_lines(runs: list[dict]) -> list[str]:
    """The largest size one engine trained over another's, for the pairs the project's targets name."""
    largest = {}
    for r in runs:
        if r["ok"]:
            largest[r["engine"]] = max(largest.get(r["engine"], 0), r["params"])
    pairs = [(a, b) for a, b in RATIOS if a in largest and b in largest]
    if not pairs:
        return []
    return ["", "Largest size trained, one engine over another: " + "; ".join(
        f"{LABELS[a]} / {LABELS[b]} = {largest[a] / largest[b]:.2f}x" for a, b in pairs) + "."]


def model_state_lines(ours: list[dict], precision: str) -> list[str]:
    """For the LoRA engines: the bytes of model state a rank holds (its shards of the base, the 4-bit codes for
    QLoRA, the adapter's parameters, gradients and optimizer state, the quantization scales every rank keeps whole),
    as the run counted them, against the estimator's `model_states`."""
    lora = [r for r in ours if r["engine"] in ("hf_zero3_qlora", "hf_zero3_lora")]
    if not lora:
        return []
    lines = ["", "Model state per rank (`hf_zero.model_state_memory` plus the 4-bit scales held), against the "
             "estimator's (`hf-zero estimate --qlora` for the 4-bit base):", "",
             "| engine | params | measured (GiB) | estimate (GiB) | ratio |", "|---|---|---|---|---|"]
    for r in lora:
        held = max(sum(sum(v.values()) for v in x["model_states"].values()) + x.get("quant_state_bytes", 0)
                   for x in r["ranks"])
        est = estimate_row(r["layers"], "none", precision, r["engine"]).model_states
        lines.append(f"| {LABELS[r['engine']]} | {r['params'] / 1e9:.2f}B | {held / GIB:.3f} | {est / GIB:.3f} | "
                     f"{held / est:.3f} |")
    return lines


def qlora_lines(runs: list[dict]) -> list[str]:
    """What the LoRA engines train (`benchmarks/_capacity_qlora.py`), said once above the table."""
    if not any(r["engine"] in ("hf_zero3_qlora", "hf_zero3_lora", "fsdp_qlora", "ds3_qlora") for r in runs):
        return []
    return ["Every engine trains LoRA (r=8, alpha 16, dropout 0.1, every linear layer of the decoder) with activation "
            "checkpointing on a frozen base: in 4 bits for the QLoRA engines (NF4, double quantization, compute in "
            "fp32, the codes stored as float32 as FSDP needs them; read from a directory transformers saves from "
            "its 4-bit load), in fp32 for hf_zero's LoRA. The peers as PEFT's guides set them up; see "
            "`benchmarks/_capacity_qlora.py`.", ""]


def peer_lines(runs: list[dict]) -> list[str]:
    """Each peer's configuration as its runs recorded it (`peer_config`), one per engine."""
    seen: dict[str, dict] = {}
    for r in runs:
        config = r["ranks"][0].get("peer_config") if r["ok"] else None
        if config and r["engine"] not in seen:
            seen[r["engine"]] = config
    if not seen:
        return []
    lines = ["", "## The peers' configurations (as each run recorded it)", ""]
    for engine, config in seen.items():
        lines += [f"- {LABELS.get(engine, engine)}: `{json.dumps(config, sort_keys=True)}`"]
    return lines


def write_report(report: dict, out: Path, name: str) -> None:
    runs = report["runs"]
    precision = report.get("precision", "bf16")
    how = ("bf16 mixed precision" if precision == "bf16" else
           "fp32 throughout, this CPU having no bf16 matrix instructions") + ", AdamW"
    lines = [f"# Capacity on this machine: 2 ranks, {report['budget_gib']} GiB resident per rank "
             f"({report.get('total_budget_gib', 2 * report['budget_gib'])} GiB for both)", "",
             f"LLaMA shapes {json.dumps(report['shape'])} with L layers; {report['steps']} steps of 1 x {report['seq']} "
             f"tokens per rank ({how}), then one checkpoint with each engine's own save. "
             "Disk, measured at the start of each invocation (sequential, uncached): " + "; ".join(
                 f"{d['write_gb_s']:.2f} GB/s write, {d['read_gb_s']:.2f} GB/s read"
                 for d in report.get("disk_all", [report["disk"]])) + ".", "",
             *qlora_lines(runs),
             "## Largest model each engine trained and saved", "",
             "| engine | largest | peak RSS in training (GiB/rank) | peak RSS in the save | last step (s) | tokens/s | "
             "save (s) | next size |", "|---|---|---|---|---|---|---|---|"]
    engines = list(dict.fromkeys(r["engine"] for r in runs))
    for engine in engines:
        ok = [r for r in runs if r["engine"] == engine and r["ok"]]
        bad = sorted((r for r in runs if r["engine"] == engine and not r["ok"]), key=lambda r: r["params"])
        nxt = f"{bad[0]['params'] / 1e9:.2f}B: {bad[0]['why']}" if bad else "not tried"
        if not ok:
            lines.append(f"| {LABELS.get(engine, engine)} | none | | | | | | {nxt} |")
            continue
        top = max(ok, key=lambda r: r["params"])
        lines.append(
            f"| {LABELS.get(engine, engine)} | {top['params'] / 1e9:.2f}B | {_rank_max(top, 'train_peak_rss') / GIB:.2f} | "
            f"{_rank_max(top, 'save_peak_rss') / GIB:.2f} | {max(r['step_s'][-1] for r in top['ranks']):.1f} | "
            f"{min(r['tokens_per_s'] for r in top['ranks']):.1f} | {_rank_max(top, 'save_s'):.1f} | {nxt} |")
    lines += ratio_lines(runs)
    if name.endswith("compare"):
        lines += compare_section(report)
    ours = [r for r in runs if r["ok"] and r["engine"].startswith("hf_zero")]
    if ours:
        lines += ["", "## hf_zero's peaks against `hf-zero estimate`", "",
                  "Peak resident memory in training minus the process's baseline (Python, torch, transformers), "
                  "against the estimator's per-rank total (model states, gathered units, activations, buffers; "
                  "with `offload_dir` the host's share too, the device and the host being one memory here).", "",
                  "| engine | params | peak - baseline (GiB) | estimate (GiB) | ratio |", "|---|---|---|---|---|"]
        for r in sorted(ours, key=lambda r: (r["engine"], r["params"])):
            peak = max(x["train_peak_rss"] - x["base_rss"] for x in r["ranks"])
            offload = {"hf_zero3_disk": "disk", "hf_zero3_disk_params": "disk+params"}.get(r["engine"], "none")
            est = estimated_bytes(r["layers"], offload, precision, r["engine"])
            lines.append(f"| {LABELS[r['engine']]} | {r['params'] / 1e9:.2f}B | {peak / GIB:.2f} | {est / GIB:.2f} | "
                         f"{peak / est:.3f} |")
        lines += model_state_lines(ours, precision)
    lines += peer_lines(runs)
    lines += ["", "## Every run", "",
              "| engine | params | result | setup peak | train peak | save peak | 16Ψ/N | steps (s) | save (s) | losses |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not r["ok"]:
            lines.append(f"| {LABELS.get(r['engine'], r['engine'])} | {r['params'] / 1e9:.2f}B | {r['why']} | | | | | | | |")
            continue
        steps = ", ".join(f"{s:.1f}" for s in max((x["step_s"] for x in r["ranks"]), key=sum))
        lines.append(
            f"| {LABELS.get(r['engine'], r['engine'])} | {r['params'] / 1e9:.2f}B | ok | "
            f"{_rank_max(r, 'setup_peak_rss') / GIB:.2f} | {_rank_max(r, 'train_peak_rss') / GIB:.2f} | "
            f"{_rank_max(r, 'save_peak_rss') / GIB:.2f} | {floor_bytes(r['params']) / GIB:.2f} | {steps} | "
            f"{_rank_max(r, 'save_s'):.1f} | {', '.join(f'{x:.3f}' for x in r['ranks'][0]['losses'])} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for engine in engines:
        ok = sorted((r for r in runs if r["engine"] == engine and r["ok"]), key=lambda r: r["params"])
        bad = [r for r in runs if r["engine"] == engine and not r["ok"]]
        xs = [r["params"] / 1e9 for r in ok]
        line = ax.plot(xs, [_rank_max(r, "train_peak_rss") / GIB for r in ok], marker="o",
                       label=LABELS.get(engine, engine))[0]
        for r in bad:
            ax.plot([r["params"] / 1e9], [report["budget_gib"]], marker="x", markersize=10, color=line.get_color())
    ax.axhline(report["budget_gib"], color="grey", linestyle="--", label="budget per rank")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("peak resident memory per rank in training (GiB)")
    ax.set_title(f"Largest LLaMA trained on 2 ranks, {precision} (x: the first size that did not fit)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
