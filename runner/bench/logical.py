"""`make bench-logical`: a logical batch larger than memory (physical_batch_size) and bf16, side by side.

    python -m runner.bench.logical                       # this machine's best device, both workloads
    python -m runner.bench.logical --device cpu --repeats 5 --workloads cnn_mnist
    python -m runner.bench.logical --quick               # small batches, 2 repeats: every code path

One process, one model per workload (a fresh copy per row, same seed), the same warm-up for every row, interleaved
repeats (runner/bench/common.py). Rows, each a full private step (Method.step: chunks, noise, optimizer step):

    B=128                 the unchunked step at the physical size (the baseline)
    B=2048 P=128          a logical batch 16x larger, in chunks of 128: one noise draw, one update
    B=128 bf16            the unchunked step under precision=bf16 (against fp32 at the same batch)

Columns: step_ms, ms_per_example (step time / B), x_per_example (its ratio to B=128's), step_mem_mb (peak bytes
allocated during the step above those live at its start) and mem_x (its ratio to B=128's). Targets (issue 20):
B=2048 P=128 within 1.1x of B=128's memory and 1.15x of its time per example; bf16 has no target (CPU bf16 may
well be slower: the numbers say). Saves outputs/bench/logical_<device>.csv.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import torch

from runner.bench.common import (IMDB, MNIST, Workload, arguments, bench_device, contender, interleaved_times,
                                 median, select_workloads, step_memory_bytes, synthetic_batch, timed_repeats)
from runner.metrics import device_name, write_csv
from runner.models import MODELS

COLUMNS = ["workload", "model", "method", "row", "batch", "physical", "precision", "step_ms", "ms_per_example",
           "x_per_example", "step_mem_mb", "mem_x", "note"]


def workloads(quick: bool = False) -> list[Workload]:
    """The JL paper's MNIST CNN and Lee & Kifer's IMDB transformer, at the physical size P (B=P is the baseline)."""
    p = 16 if quick else 128
    return [Workload("cnn_mnist", "bu_cnn", MNIST, p), Workload("transformer_imdb", "transformer", IMDB, p)]


def rows_for(w: Workload, factor: int) -> dict[str, tuple[int, int | None, str]]:
    """label -> (logical batch, physical_batch_size, precision)."""
    return {f"B={w.batch}": (w.batch, None, "fp32"),
            f"B={w.batch * factor} P={w.batch}": (w.batch * factor, w.batch, "fp32"),
            f"B={w.batch} bf16": (w.batch, None, "bf16")}


def bench_workload(w: Workload, device: torch.device, method: tuple[str, dict], repeats: int, warmup: int,
                   factor: int) -> list[dict]:
    torch.manual_seed(0)
    kwargs = {"dropout": 0.0} if w.model == "transformer" else {}
    base = MODELS.build(w.model, w.info, **kwargs).to(device)
    name, options = method
    steps, notes, batches = {}, {}, {}
    for label, (batch, physical, precision) in rows_for(w, factor).items():
        x, y = synthetic_batch(w.info, batch, device)
        c, note = contender(name, options, base, x, y, lambda ps: torch.optim.SGD(ps, lr=0.1),
                            batch / w.info.train_size, float(batch),
                            configure={"physical_batch_size": physical, "precision": precision})
        notes[label], batches[label] = note, batch
        if c is not None:
            steps[label] = c
    times = interleaved_times({k: c.step for k, c in steps.items()}, device, repeats, warmup, budget_s=1e9)
    memory = {k: step_memory_bytes(c.step, device, before=c.zero_grad) for k, c in steps.items()}
    base_label = f"B={w.batch}"
    per_example = {k: median(ts) / batches[k] for k, ts in times.items()}
    out = []
    for label, (batch, physical, precision) in rows_for(w, factor).items():
        row = dict(workload=w.name, model=w.model, method=f"{name}-{options.get('mode', '')}".rstrip("-"), row=label,
                   batch=batch, physical=physical or batch, precision=precision, note=notes[label])
        if label in times:
            row.update(step_ms=1e3 * median(times[label]), ms_per_example=1e3 * per_example[label],
                       x_per_example=per_example[label] / per_example.get(base_label, float("nan")),
                       step_mem_mb=memory[label] / 2**20,
                       mem_x=memory[label] / memory[base_label] if memory.get(base_label) else float("nan"))
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.logical", __doc__, repeats=5, warmup=1, budget=1e9,
                   quick="small batches (P=16), 2 repeats: every code path in seconds",
                   workloads=[w.name for w in workloads()], out="logical_<device>.csv")
    ap.add_argument("--factor", type=int, default=16, help="logical batch = factor x the physical size P")
    ap.add_argument("--mode", default="bk", help="method=reweight's mode (bk: the default)")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    repeats = timed_repeats(args)
    rows = []
    for w in select_workloads(workloads(args.quick), args.workloads, "bench.logical"):
        print(f"bench.logical: {w.name} ({w.model}, P={w.batch}, B={w.batch * args.factor}) on {device}", flush=True)
        rows += bench_workload(w, device, ("reweight", {"mode": args.mode}), repeats, args.warmup, args.factor)
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    print(f"device: {device_name(device)}; {repeats} interleaved repeats; reweight method.mode={args.mode}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    out = Path(args.out) / f"logical_{device.type}{'_quick' if args.quick else ''}.csv"
    write_csv(out, table.to_dict("records"))
    print(f"bench.logical: wrote {out}")
    return table


if __name__ == "__main__":
    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.logical"))
