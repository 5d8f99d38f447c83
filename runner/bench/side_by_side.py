"""The command line of the benches that time one setting two ways in one process, per workload and method
(bench-layout: NCHW / channels-last; bench-threads: autograd's device thread / the calling thread)."""
from __future__ import annotations

from typing import Callable

import pandas as pd
import torch

from runner.bench.clip import ALL, add_suite_argument, suite_workloads, workload_names
from runner.bench.common import (arguments, bench_device, interleaved_times, median, save_frames, select_workloads,
                                 synthetic_batch, timed_repeats)
from runner.errors import DprunError
from runner.models import MODELS


def timed_each_way(w, labels: list[str], device: torch.device, repeats: int, warmup: int, budget_s: float,
                   ways: tuple[str, ...], contenders: Callable) -> tuple[dict, dict, torch.nn.Module]:
    """The workload's model (seed 0) and batch; contenders(label, model, x, y) -> ({way: step}, note) for each
    label; every step timed in turn (interleaved). Returns ({label: {way: median ms}} (nan: not built that way),
    {label: note}, the model)."""
    torch.manual_seed(0)
    model = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    steps, notes = {}, {}
    for label in labels:
        built, note = contenders(label, model, x, y)
        if note:
            notes[label] = note
        steps.update({(label, way): step for way, step in built.items()})
    times = interleaved_times(steps, device, repeats, warmup, budget_s)
    ms = {label: {way: 1e3 * median(times.get((label, way), [])) for way in ways} for label in labels}
    return ms, notes, model


def side_by_side_main(name: str, doc: str, argv: list[str] | None, compare: Callable[..., list[dict]],
                      repeats: int, warmup: int) -> pd.DataFrame:
    """`python -m runner.bench.<name>`: compare(workload, labels, device, repeats, warmup, budget_s, precision) ->
    rows, for each chosen workload; the table printed and saved as <name>_<device>.csv."""
    ap = arguments(f"python -m runner.bench.{name}", doc, repeats=repeats, warmup=warmup, budget=60.0,
                   quick="batches / 8: a smoke run", workloads=workload_names(), out=f"{name}_<device>.csv")
    add_suite_argument(ap)
    ap.add_argument("--methods", default="nonprivate,reweight-bk", help="comma-separated eager rows of bench-clip: "
                    + ", ".join(ALL))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"])
    args = ap.parse_args(argv)
    labels = args.methods.split(",")
    unknown = [m for m in labels if m not in ALL]
    if unknown:
        raise DprunError(f"--methods: unknown row {unknown[0]!r}; choose from {', '.join(ALL)}")
    device = bench_device(args.device)
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, f"bench-{name}")
    rows = []
    for w in chosen:
        print(f"[bench-{name}] {w.name}: model={w.model} B={w.batch} ...", flush=True)
        rows += compare(w, labels, device, timed_repeats(args), args.warmup, args.budget, args.precision)
    df = pd.DataFrame(rows)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return save_frames([df], args.out, name, device, args.quick, f"bench-{name}")
