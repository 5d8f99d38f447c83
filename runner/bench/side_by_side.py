"""The command line of the benches that time one setting two ways in one process, per workload and method
(bench-layout: NCHW / channels-last; bench-threads: autograd's device thread / the calling thread)."""
from __future__ import annotations

from typing import Callable

import pandas as pd

from runner.bench.clip import ALL, add_suite_argument, suite_workloads, workload_names
from runner.bench.common import arguments, bench_device, save_frames, select_workloads, timed_repeats
from runner.errors import DprunError


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
