"""`make bench-compare BASE=<commit>`: this tree's steps against another tree's, interleaved step by step.

    python -m runner.bench.compare --base 0c009e4 --workloads fig6_b16,transformer_imdb
    python -m runner.bench.compare --base 0c009e4 --methods nonprivate,reweight-bk --repeats 40
    python -m runner.bench.compare --base .                 # A/A: this tree against itself, the noise floor
    python -m runner.bench.compare --base .base --workloads cnn_mnist --batch 2 --repeats 400 --methods nonprivate,reweight-bk
                                                            # host-bound: a small model's GPU step, on the CPU
    python -m runner.bench.compare --device cuda --suite gpu --base .base   # a folder: e.g. a tree exported
                                                            # here and carried to a machine without .git

"Costs at most 3% more than before" needs before and after timed alike. Timed in two processes minutes apart, the
same step moved by +-10% on this project's shared 2-core machine, more than the effects in question. Here each tree
runs in its own process (runner/bench/compare_worker.py, importing that tree's own `runner`), both built before any
timing, and the parent asks them for one step at a time, alternating (base, this, base, this, ... over every
method), so a slow patch of the machine hits both trees alike; one process computes while the other waits on a pipe.
Both processes get the same heap settings (MALLOC_*_THRESHOLD_ = 1 GiB, as runner/heap.py) and, unless the
environment sets it, OMP_WAIT_POLICY=PASSIVE: otherwise the waiting process's OpenMP threads spin after its last
step and compete with the other's (two 2-thread teams on 2 cores: every step ~1.7x slower, the non-private one too).
Measured here (A/A, --base .): this / base within 0.98-1.00 on fig6_b16 over 30 steps.

--base: a git commit (exported with `git archive` into a temporary folder) or a folder holding a tree. The base tree
must have the bench API compare_worker.py uses (runner.bench.clip.method_contender, there since the certified
clipping work). Columns: the median step of each tree, this / base, each tree's ratio to its own non-private
step, each tree's peak step memory (bench-clip's measure, one step each) and its computing operators per step
(~ kernels launched, runner/bench/opcount.py `kernels`: what a host-bound GPU step pays per operator, countable on the
CPU at the GPU workload's own batch, since which operators a step runs can depend on B: e.g. runner/norms/streaming.py
CAPTURE_BYTES). A row one tree cannot build (a workload or method newer than the base) is measured in the other, with
the reason in its note and no ratio between the trees.
Saves outputs/bench/compare_<device>.csv.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pandas as pd

from runner.bench.common import arguments, bench_device, median, select_workloads, timed_repeats
from runner.bench.device_time import shown_columns
from runner.bench.clip import ALL, ON_REQUEST, add_suite_argument, suite_workloads, workload_names
from runner.errors import DprunError
from runner.heap import RETAIN_BYTES
from runner.metrics import write_csv

HERE = Path(__file__).resolve().parents[2]  # this tree's root
WORKER = Path(__file__).resolve().with_name("compare_worker.py")
COLUMNS = ["pair", "workload", "model", "batch", "method", "base_ms", "this_ms", "this_over_base", "base_x_nonprivate",
           "this_x_nonprivate", "base_mem_mb", "this_mem_mb", "base_kernels", "this_kernels", "base_host_ms", "this_host_ms",
           "base_gpu_ms", "this_gpu_ms", "base_mallocs", "this_mallocs", "steps_timed", "note"]
# on CUDA only: each tree's median time until its step returned, its kernels' device time and its allocator calls into
# the driver per step (runner/bench/device_time.py)
DEVICE_COLUMNS = ["base_host_ms", "this_host_ms", "base_gpu_ms", "this_gpu_ms", "base_mallocs", "this_mallocs"]


def export_commit(commit: str, repo: Path, into: Path) -> Path:
    """The tree of `commit` in `repo`, written under `into` (git archive: tracked files only, no .git)."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True)
    if archive.returncode != 0:
        raise DprunError(f"--base {commit!r}: not a commit of {repo} ({archive.stderr.decode().strip()})")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def resolve_tree(base: str, scratch: Path) -> Path:
    """--base as a tree folder: a folder with runner/ as is, else a commit of this repository exported."""
    folder = Path(base)
    if (folder / "runner").is_dir():
        return folder.resolve()
    return export_commit(base, HERE, scratch)


def without_trees(pythonpath: str) -> str:
    """PYTHONPATH less every folder holding a `runner` package (no other tree's modules may reach a worker); folders
    of installed packages stay (a GPU machine's `pip install --target .site` wheels are found through it)."""
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and not (Path(p) / "runner").is_dir())


class Tree:
    """One tree's worker process: build a workload's contenders, time one step of a contender."""

    def __init__(self, root: Path, device: str):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(RETAIN_BYTES), MALLOC_TRIM_THRESHOLD_=str(RETAIN_BYTES))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the idle worker's threads sleep, not spin
        env["PYTHONPATH"] = without_trees(env.get("PYTHONPATH", ""))  # the worker puts its tree first
        self.root = root
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(root), device], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=root)

    def ask(self, **request) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:  # the worker was gone before the request: killed, or it exited
            line = ""
        if not line:
            raise DprunError(f"the benchmark worker for {self.root} stopped during {request}: {self.how_it_ended()}")
        return json.loads(line)

    def how_it_ended(self) -> str:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "it closed its output (its error is printed above)"
        if code == -9:
            return "killed (SIGKILL: on Linux usually the kernel's out-of-memory killer; try a smaller --batch)"
        return f"exit code {code} (its error is printed above)"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def compare_workload(trees: dict[str, Tree], w, methods: list[str], quick: bool, repeats: int, warmup: int,
                     gap_s: float, suite: str = "default", precision: str = "fp32", batch: int | None = None,
                     memory_format: str = "auto") -> list[dict]:
    built = {name: t.ask(build=w.name, methods=methods, quick=quick, suite=suite, precision=precision, batch=batch,
                         memory_format=memory_format) for name, t in trees.items()}
    if batch:  # each worker built its tree's workload at this batch (it says which)
        used = {b["batch"] for b in built.values() if "batch" in b}
        if used != {batch}:
            raise DprunError(f"bench-compare --batch {batch}: the workers built {w.name} at batch {sorted(used)}")
        w = dataclasses.replace(w, batch=batch)
    if len({b.get("precision") for b in built.values()}) > 1:
        print(f"[bench-compare] {w.name}: precision " + ", ".join(f"{n} {b.get('precision')}" for n, b in built.items()))
    if len({b.get("memory_format") for b in built.values()}) > 1:
        print(f"[bench-compare] {w.name}: memory_format " + ", ".join(f"{n} {b.get('memory_format')}"
                                                                    for n, b in built.items()))
    for name, b in built.items():  # each worker must have imported its own tree (not an installed copy)
        if "runner" in b and not Path(b["runner"]).resolve().is_relative_to(trees[name].root):
            raise DprunError(f"the {name} worker imported runner from {b['runner']}, not from {trees[name].root}")
    rows, steps = [], []  # steps: (tree, label) pairs to time; a row only one tree has is still measured there
    for label in methods:
        notes = [f"{name}: {b['error'] if 'error' in b else b['notes'].get(label, '')}" for name, b in built.items()
                 if "error" in b or label not in b.get("built", [])]
        rows.append(dict(workload=w.name, model=w.model, batch=w.batch, method=label, note="; ".join(notes)))
        steps += [(name, label) for name, b in built.items() if label in b.get("built", [])]
    times = {key: [] for key in steps}
    host = {key: [] for key in steps}  # seconds until each timed step returned, before the device finished it
    for r in range(warmup + repeats):
        # the trees' order alternates by round: a step that always followed the other tree's step of the same kind
        # (and one that always followed a different kind) read up to 4% apart in an A/A run (--base .)
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for label in methods:
            for name in order:
                if (name, label) not in times:
                    continue
                time.sleep(gap_s)
                answer = trees[name].ask(step=label)
                if "error" in answer:
                    raise DprunError(f"{name} tree, {w.name} {label}: {answer['error']}")
                if r >= warmup:
                    times[(name, label)].append(answer["s"])
                    host[(name, label)].append(answer["host_s"])
    t = {key: median(ts) for key, ts in times.items()}
    memory, ops, gpu = {}, {}, {}  # one step each, after the timing (bench-clip's measure: peak tensor bytes above the
    for name, label in steps:  # step's start), one step's computing operators (~ kernels: a host-bound GPU step), and
        memory[(name, label)] = trees[name].ask(memory=label).get("bytes", math.nan) / 2**20  # (CUDA) its kernels'
        ops[(name, label)] = trees[name].ask(ops=label).get("kernels", math.nan)  # device time
        gpu[(name, label)] = trees[name].ask(device_time=label)  # {"ms", "mallocs"}
    for row in rows:
        label = row["method"]
        for name in trees:  # each tree's own columns where it ran the row; ratios where both did
            if (name, label) in t:
                row.update({f"{name}_ms": 1e3 * t[(name, label)], f"{name}_mem_mb": memory[(name, label)],
                            f"{name}_kernels": ops[(name, label)], f"{name}_host_ms": 1e3 * median(host[(name, label)]),
                            f"{name}_gpu_ms": gpu[(name, label)].get("ms", math.nan),
                            f"{name}_mallocs": gpu[(name, label)].get("mallocs", math.nan), "steps_timed": repeats})
                if (name, "nonprivate") in t:
                    row[f"{name}_x_nonprivate"] = t[(name, label)] / t[(name, "nonprivate")]
        if ("base", label) in t and ("this", label) in t:
            row["this_over_base"] = t[("this", label)] / t[("base", label)]
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.compare", __doc__, repeats=20, warmup=3, budget=0.0,
                   quick="batches / 8 and 2 repeats: a smoke run", workloads=workload_names(),
                   out="compare_<device>.csv")
    add_suite_argument(ap)
    ap.add_argument("--base", required=True, help="a commit of this repository, or a folder holding a tree ('.': "
                    "this tree against itself, the measurement's noise)")
    ap.add_argument("--methods", default="nonprivate,reweight-twopass,reweight-recompute,reweight-bk",
                    help=f"comma-separated rows of bench-clip, each timed in both trees; valid: {', '.join(ALL)}")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="pause before each step")
    ap.add_argument("--pairs", type=int, default=1, help="fresh pairs of worker processes, one after the other: the "
                    "same code in two processes can differ by up to ~10%% on a host-bound step (A/A, --batch 2), so a few "
                    "pairs and their median ratio (printed with its range) tell a 3%% change from process noise")
    ap.add_argument("--batch", type=int, default=None, help="every workload at this batch in both trees (e.g. 2: a "
                    "step bound by the host's Python and operator dispatch, as a small model's GPU step is)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"],
                    help="each tree's precision= where it has one (a tree without runs torch's defaults: on CUDA, "
                         "TF32 convolutions and float32 matmuls; tf32 is then the like-for-like choice for conv nets)")
    ap.add_argument("--memory-format", default="auto", choices=["auto", "channels_last", "contiguous"],
                    help="each tree's memory_format= where it has one (a tree without runs NCHW: contiguous is then "
                         "the like-for-like choice for CPU conv nets; runner/memory_format.py)")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in ALL]
    if unknown:
        raise DprunError(f"bench-compare: unknown method row {unknown[0]!r}; valid: {', '.join(ALL)}")
    if args.pairs < 1:
        raise DprunError(f"bench-compare: --pairs {args.pairs} is not valid: at least 1 pair of worker processes")
    if args.batch is not None and args.batch < 1:
        raise DprunError(f"bench-compare: --batch {args.batch} is not valid: a batch of at least 1 example")
    device = bench_device(args.device)
    repeats = timed_repeats(args)
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, "bench-compare")
    rows: list[dict] = []
    path = Path(args.out) / f"compare_{device.type}{'_quick' if args.quick else ''}.csv"
    try:
        measure_pairs(args, device, repeats, methods, chosen, rows)
    except BaseException:  # a worker killed or a step failed, or ctrl-c: the workloads measured so far are kept
        if rows:
            write_csv(path, pd.DataFrame(rows).reindex(columns=shown_columns(COLUMNS, DEVICE_COLUMNS, device)).to_dict("records"))
            print(f"[bench-compare] stopped: the {len(rows)} rows measured before are saved in {path}")
        raise
    df = pd.DataFrame(rows).reindex(columns=shown_columns(COLUMNS, DEVICE_COLUMNS, device))
    write_csv(path, df.to_dict("records"))
    with pd.option_context("display.max_rows", None, "display.width", 250, "display.float_format", "{:.3f}".format):
        print(df.to_string(index=False))
        if args.pairs > 1:
            print(f"[bench-compare] this / base over {args.pairs} pairs of processes: median (min - max)")
            print(pair_summary(df).to_string(index=False))
    print(f"[bench-compare] saved {path}")
    return df


def measure_pairs(args, device, repeats: int, methods: list[str], chosen: list, rows: list[dict]) -> None:
    """Every pair of worker processes over every chosen workload, each workload's rows appended to `rows` as soon as
    they are measured."""
    with tempfile.TemporaryDirectory(prefix="dprun-base-") as scratch:
        base_root = resolve_tree(args.base, Path(scratch))
        print(f"[bench-compare] base {args.base} ({base_root}) vs this tree ({HERE}); {device}, {repeats} "
              f"interleaved steps each, median" + (f"; {args.pairs} pairs of processes" if args.pairs > 1 else ""))
        for pair in range(args.pairs):
            trees = {"base": Tree(base_root, str(device)), "this": Tree(HERE, str(device))}
            try:
                for w in chosen:
                    print(f"[bench-compare] {w.name}: model={w.model} B={args.batch or w.batch}"
                          + (f", pair {pair + 1} of {args.pairs}" if args.pairs > 1 else "") + " ...", flush=True)
                    labels = [m for m in methods if m in w.methods or m in ON_REQUEST]
                    found = compare_workload(trees, w, labels, args.quick, repeats,
                                             args.warmup, args.gap_ms / 1e3, args.suite, args.precision, args.batch,
                                             args.memory_format)
                    rows += [dict(row, pair=pair + 1) for row in found]
            finally:
                for tree in trees.values():
                    tree.close()


def pair_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per workload and method: the median of this / base over the pairs of processes, and its range."""
    ratios = df.dropna(subset=["this_over_base"]).groupby(["workload", "batch", "method"], sort=False)["this_over_base"]
    return ratios.agg(pairs="count", median="median", min="min", max="max").reset_index()


if __name__ == "__main__":
    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.compare"))
