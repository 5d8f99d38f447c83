"""`make bench-clip`: the exact per-example clipping methods side by side, as ratios to non-private and to Opacus.

    python -m runner.bench.clip                       # all workloads, this machine's best device
    python -m runner.bench.clip --device cpu --repeats 5 --workloads cnn_mnist,fig6_b128
    python -m runner.bench.clip --quick               # every code path, small batches, 2 repeats (a smoke run)
    python -m runner.bench.clip --device cpu --methods nonprivate,reweight-bk,reweight-bk-secure,noise-seeded,noise-secure
                                                      # rng=secure's cost (issue 29)
    python -m runner.bench.clip --device cuda --suite gpu --precision tf32            # every row with precision=tf32
    python -m runner.bench.clip --device cuda --suite gpu --compile reduce-overhead   # issue 12's GPU workloads
                                                      # (make bench-gpu), plus compiled nonprivate / reweight-bk rows
    python -m runner.bench.clip --device cuda --suite gpu --workloads gpt2small_t128,gpt2small_t512 --compile default
                                                      # the GPT-2-small-shaped stack (issue 31)

One process, one model per workload (a fresh copy per method, same seed), the same warm-up for every method,
interleaved repeats; a step is Method.step (privatize + noise + optimizer step). Columns: median step time,
ratio to non-private, ratio to Opacus's fastest mode on the same workload, peak step memory and its ratio to
non-private (runner/bench/common.py defines the memory measure on CPU and CUDA), and the aten operators
dispatched per step (runner/bench/opcount.py: all, and leaves ~ kernel launches). rng=secure's cost
(runner/randomness.py): the row `reweight-bk-secure` is reweight-bk with its noise from SecureRandom (each step
waits for the next step's noise, drawn ahead: no overlap counted, the cost on a machine with no free core), and
`noise-seeded` / `noise-secure` time the noise alone (add_noise_and_scale over the model's parameters, the secure
one drawn in the step, not ahead on the worker thread); `x_seeded` is a secure row over its seeded twin. Inputs are synthetic tensors
of the datasets' shapes (speed does not depend on pixel values). Methods that reject a model (a one-line
DprunError) are rows with a note. Saves outputs/bench/clip_<device>.csv.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from runner.bench.common import (CIFAR10, IMDB, MNIST, arguments, bench_device, contender,
                                 interleaved_times, median, select_workloads, step_memory_bytes, synthetic_batch,
                                 timing_columns, timed_repeats)
from runner import memory_format as layout
from runner.bench import common
from runner.bench.device_time import kernel_ms, mallocs_per_step, shown_columns
from runner.bench.opcount import kernels, op_counts
from runner.data.base import DataInfo
from runner.errors import DprunError
from runner.methods.noise import add_noise_and_scale
from runner.metrics import device_name, write_csv
from runner.models import MODELS
from runner.randomness import SecureRandom

# label -> (method name, method options); the Opacus rows are the JL paper's DP-SGD-Outer
METHOD_VARIANTS = {
    "nonprivate": ("nonprivate", {}),
    "nxbp": ("nxbp", {}),
    "multiloss": ("multiloss", {}),
    "reweight-twopass": ("reweight", {"mode": "twopass"}),
    "reweight-bk": ("reweight", {"mode": "bk"}),
    "reweight-recompute": ("reweight", {"mode": "recompute"}),
    "opacus-hooks": ("opacus", {"grad_sample_mode": "hooks"}),
    "opacus-ghost": ("opacus", {"grad_sample_mode": "ghost", "uncertified_ok": True}),  # timed; training refuses
    "opacus-functorch": ("opacus", {"grad_sample_mode": "functorch"}),
}
SECURE = ["reweight-bk-secure", "noise-seeded", "noise-secure"]  # rng=secure's cost beside its seeded twin
# rows timed only when --methods names them: bk with Recorder (method.recorder=full, auto's choice on CUDA: a GPU's
# host-bound step prefers a backward with no Python between its kernels) or the lean recorder (method.recorder=lean,
# auto's choice on the CPU: the least memory), and the lean recorder with its
# record-keeping layers' norms after the backward or inside it whatever the device, or every layer's after it
# (method.defer=on / off / all; the default, auto, is on on CUDA, off on the CPU) (device-check); bk keeping no
# per-example gradient (method.keep=0: the least memory) or only those that save memory (method.keep_mb=0); bk with
# its kept per-example gradients formed after the backward or inside it whatever the device (method.late=on / off;
# the default, auto, is on on the CPU, off on CUDA)
ON_REQUEST = {"reweight-bk-full": ("reweight", {"mode": "bk", "recorder": "full"}),
              "reweight-bk-lean": ("reweight", {"mode": "bk", "recorder": "lean"}),
              "reweight-bk-inline": ("reweight", {"mode": "bk", "defer": "off"}),
              "reweight-bk-defer": ("reweight", {"mode": "bk", "defer": "on"}),
              "reweight-bk-deferall": ("reweight", {"mode": "bk", "defer": "all"}),
              "reweight-bk-keep0": ("reweight", {"mode": "bk", "keep": 0}),
              "reweight-bk-keepmb0": ("reweight", {"mode": "bk", "keep_mb": 0}),
              "reweight-bk-late": ("reweight", {"mode": "bk", "late": "on"}),
              "reweight-bk-nolate": ("reweight", {"mode": "bk", "late": "off"})}
DEFAULT_ROWS = list(METHOD_VARIANTS) + SECURE
ALL = DEFAULT_ROWS + list(ON_REQUEST)
# the footnote of opacus-ghost's rows: timed as a peer, refused for training (runner/methods/opacus_peer.py)
UNCERTIFIED = ("timed only: not certified, refused for training (4.25 C on a crafted input: python -m "
               "runner.bench.adversarial)")
FIG6 = ["nonprivate", "nxbp", "reweight-twopass", "reweight-bk"] + SECURE  # L&K figure 6: nxBP vs ReweightGP over B
IMAGENET256 = DataInfo("imagenet256", (3, 256, 256), 1000, "image", None, 1281167, 50000)
GPU = ["nonprivate", "reweight-twopass", "reweight-bk", "reweight-recompute", "opacus-hooks", "opacus-ghost",
       "opacus-functorch"] + SECURE
COLUMNS = ["workload", "model", "batch", "method", "precision", "memory_format", "step_ms", "x_nonprivate", "x_nonprivate_compiled",
           "x_opacus_best", "x_seeded", "step_mem_mb", "mem_x_nonprivate", "faults_per_step", "aten_ops", "leaf_ops", "kernels",
           "host_ms", "gpu_ms", "mallocs_per_step", "steps_timed", "note"]
# on CUDA only: the median time until a step returned, its kernels' device time, and its allocator calls into the
# driver (runner/bench/device_time.py): gpu_ms well below step_ms is a GPU waiting on the host
DEVICE_COLUMNS = ["host_ms", "gpu_ms", "mallocs_per_step"]


@dataclass
class Workload(common.Workload):
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_ROWS))
    model_kwargs: dict = field(default_factory=dict)


def workloads(quick: bool = False) -> list[Workload]:
    """JL paper figure 3 (MNIST CNN, B=256), L&K's LSTM on MNIST rows (B=128), L&K's Transformer on IMDB (B=32),
    L&K figure 6 (their CNN on MNIST, B = 16..128). --quick: the same code paths at B/8 (at least 2)."""
    scale = (lambda b: max(2, b // 8)) if quick else (lambda b: b)
    out = [Workload("cnn_mnist", "bu_cnn", MNIST, scale(256)),
           Workload("lstm_mnist", "lstm", MNIST, scale(128)),
           Workload("transformer_imdb", "transformer", IMDB, scale(32), model_kwargs={"dropout": 0.0})]
    out += [Workload(f"fig6_b{b}", "cnn", MNIST, scale(b), FIG6) for b in (16, 32, 64, 128)]
    return out


def gpu_workloads(quick: bool = False) -> list[Workload]:
    """Issue 12's GPU table: the JL paper's CNNs, transformer and BiLSTM at B=256, VGG-11 and ResNet-18 on CIFAR-10
    at B=128, ResNet-101 at 256 px, B=32; non-private, reweight and the Opacus modes (no nxBP: minutes a step).
    Issue 31: a GPT-2-small-shaped stack at T=128, B=32 and T=512, B=8 (gpt2_small)."""
    scale = (lambda b: max(2, b // 8)) if quick else (lambda b: b)
    return [Workload("cnn_mnist", "bu_cnn", MNIST, scale(256), GPU),
            Workload("papernot_cifar10", "papernot_cnn", CIFAR10, scale(256), GPU),
            Workload("transformer_imdb", "transformer", IMDB, scale(256), GPU, {"dropout": 0.0}),
            Workload("bilstm_imdb", "bilstm", IMDB, scale(256), GPU),
            Workload("vgg11_cifar10", "vgg11", CIFAR10, scale(128), GPU),
            Workload("resnet18_cifar10", "resnet18", CIFAR10, scale(128), GPU),
            Workload("resnet101_256px", "resnet101", IMAGENET256, scale(32), GPU),
            gpt2_small(128, 32, quick), gpt2_small(512, 8, quick)]


def suite_workloads(suite: str, quick: bool = False) -> list[Workload]:
    """--suite default (the CPU workloads) or gpu (gpu_workloads)."""
    return gpu_workloads(quick) if suite == "gpu" else workloads(quick)


def workload_names() -> list[str]:
    """Every workload a --workloads list may name, the GPU suite's marked."""
    return [w.name for w in workloads()] + [w.name + " (--suite gpu)" for w in gpu_workloads()]


def add_suite_argument(ap) -> None:
    ap.add_argument("--suite", default="default", choices=["default", "gpu"],
                    help="default: the CPU workloads; gpu: issue 12's GPU table (make bench-gpu)")


def gpt2_small(T: int, batch: int, quick: bool = False) -> Workload:
    """A GPT-2-small-shaped stack: 12 of dprun's post-norm encoder blocks (runner/models/transformer.py), d 768,
    12 heads, feed-forward 3072, a learned vocabulary of 8,192 with sinusoidal positions, mean-pool, 2 classes, fp32:
    91,347,458 parameters. Inputs: T token ids, zero-padded after a random length (synthetic_batch). --quick: the same
    code paths on 2 blocks of d 64 (4 heads, feed-forward 256) at T/8 and B/8."""
    name = f"gpt2small_t{T}"
    kwargs = {"layers": 12, "d_model": 768, "heads": 12, "ff": 3072, "dropout": 0.0}
    if quick:
        kwargs.update(layers=2, d_model=64, heads=4, ff=256)
        T, batch = max(8, T // 8), max(2, batch // 8)
    info = DataInfo(f"tokens{T}", (T,), 2, "text", 8192, 25000, 25000)  # IMDB's split sizes: the sample rate
    return Workload(name, "transformer", info, batch, GPU, kwargs)


def method_contender(label: str, base: torch.nn.Module, x, y, expected_batch: float, n: int,
                     compile_mode: str = "", precision: str = "fp32", memory_format: str = "auto"):
    """One method variant's Contender (runner/bench/common.py), or None and a note why there is none. A label
    ending in "+compile" steps through runner/methods/compiled.py with `compile_mode`; `precision` as the run's
    (a method that refuses it is a row with the one-line reason); `memory_format` as the run's (runner/memory_format.py)."""
    if label.startswith("noise-"):
        return noise_contender(label.removeprefix("noise-"), base, x.device), ""
    variant, _, compiled = label.partition("+")
    name, options = {**METHOD_VARIANTS, **ON_REQUEST}[variant.removesuffix("-secure")]
    return contender(name, options, base, x, y, lambda ps: torch.optim.SGD(ps, lr=0.01, foreach=True),
                     expected_batch / n, expected_batch, compile_mode=compile_mode if compiled else "",
                     configure={"precision": precision}, rng="secure" if variant.endswith("-secure") else "seeded",
                     memory_format=memory_format)


def contender_arguments(prog: str, doc: str, *, repeats: int, warmup: int, out: str, top: int, rows: str):
    """The command line of a tool that looks inside each contender's step (bench-profile, bench-peak): bench-clip's
    workloads and method rows, --precision, --top (how many `rows` it prints per contender)."""
    ap = arguments(prog, doc, repeats=repeats, warmup=warmup, budget=math.inf, quick="batches / 8: a smoke run",
                   workloads=workload_names(), out=out)
    add_suite_argument(ap)
    ap.add_argument("--methods", default="nonprivate,reweight-bk", help="comma-separated rows of bench-clip: "
                    + ", ".join(ALL))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"])
    ap.add_argument("--top", type=int, default=top, help=f"{rows} printed per contender")
    return ap


def warmed_contenders(chosen: list[Workload], labels: list[str], device: torch.device, precision: str, warmup: int,
                      tool: str, compile_mode: str = ""):
    """(workload, label, contender) for each workload and method row, built as bench-clip builds them (one model per
    workload, seed 0, the same batch for every row) and stepped `warmup` times (at least once); a row a method cannot
    run is printed with its reason and skipped. A row "<row>+compile" steps under compile=`compile_mode` (its first
    steps compile: make `warmup` cover them). An unknown row, or a compiled one without a mode, stops with one line."""
    for label in labels:
        row, _, compiled = label.partition("+")
        if row not in ALL or compiled not in ("", "compile"):
            raise DprunError(f"--methods: unknown row {label!r}; choose from {', '.join(ALL)} (each also as "
                             "<row>+compile with --compile MODE)")
        if compiled and not compile_mode:
            raise DprunError(f"--methods: row {label!r} needs --compile MODE (default | reduce-overhead | cudagraphs)")
    for w in chosen:
        torch.manual_seed(0)
        base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
        x, y = common.synthetic_batch(w.info, w.batch, device)
        for label in labels:
            c, note = method_contender(label, base, x, y, float(w.batch), w.info.train_size, compile_mode, precision)
            if c is None:
                print(f"[{tool}] {w.name} {label}: {note}")
                continue
            for _ in range(max(1, warmup)):
                c.step()
            yield w, label, c


def noise_contender(rng: str, base: torch.nn.Module, device: torch.device) -> common.Contender:
    """The noise alone: add_noise_and_scale over a copy of the model's parameters, from a seeded torch.Generator or
    from SecureRandom (rng=secure)."""
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # secure: drawn in the step (ahead=False), so the row is the generation's whole cost on this core
    gen = SecureRandom(ahead=False) if rng == "secure" else torch.Generator(device=device).manual_seed(0)
    return common.Contender(lambda: add_noise_and_scale(model, 1.0, 1.0, gen), lambda: None)


def bench_workload(w: Workload, device: torch.device, repeats: int, warmup: int, budget_s: float,
                   compile_mode: str = "", precision: str = "fp32", memory_format: str = "auto") -> list[dict]:
    labels = list(w.methods)
    if compile_mode:
        labels += [f"{m}+compile" for m in ("nonprivate", "reweight-bk") if m in w.methods]
    rows = [dict(workload=w.name, model=w.model, batch=w.batch, method=label, precision=precision) for label in labels]
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    contenders, notes = {}, {}
    for label in labels:
        contenders[label], notes[label] = method_contender(label, base, x, y, float(w.batch), w.info.train_size,
                                                           compile_mode, precision, memory_format)
        if notes[label]:
            print(f"[bench-clip] {w.name} {label}: {notes[label]}")
    contenders = {k: c for k, c in contenders.items() if c is not None}
    host: dict[str, list[float]] = {}
    timed_faults: dict[str, list[int]] = {}  # the faults inside the timed steps themselves: what the medians include
    times = interleaved_times({k: c.step for k, c in contenders.items()}, device, repeats, warmup, budget_s, host,
                              timed_faults)
    gpu = {label: kernel_ms(c.step, device) for label, c in contenders.items()}  # nan off CUDA
    mallocs = {label: mallocs_per_step(c.step, device) for label, c in contenders.items()}  # nan off CUDA
    memory = {label: step_memory_bytes(c.step, device, before=c.zero_grad) for label, c in contenders.items()}
    ops = {label: op_counts(c.step, before=c.zero_grad) for label, c in contenders.items()}
    for label, c in contenders.items():  # eager steps: a compiled one would run op by op under the counting mode
        ops[label]["kernels"] = math.nan if label.endswith("+compile") else kernels(c.step, before=c.zero_grad)
    faults = {label: statistics.fmean(timed_faults[label]) if device.type == "cpu" else math.nan for label in contenders}
    t = {label: median(ts) for label, ts in times.items()}
    opacus = [t[k] for k in t if k.startswith("opacus")]
    for r in rows:
        label = r["method"]
        if label not in contenders:
            r.update(note=notes[label])
            continue
        r.update(**timing_columns(label, times, repeats), memory_format=contenders[label].layout,
                 x_nonprivate_compiled=t[label] / t["nonprivate+compile"] if "nonprivate+compile" in t else math.nan,
                 x_opacus_best=t[label] / min(opacus) if opacus else math.nan,
                 x_seeded=t[label] / t[seeded_twin(label)] if seeded_twin(label) in t else math.nan,
                 step_mem_mb=memory[label] / 2**20,
                 mem_x_nonprivate=memory[label] / memory["nonprivate"] if memory.get("nonprivate") else math.nan,
                 faults_per_step=faults[label], host_ms=1e3 * median(host[label]), gpu_ms=gpu[label],
                 mallocs_per_step=mallocs[label],
                 **ops[label])
        if label.startswith("opacus-ghost"):
            r.update(note=UNCERTIFIED)
        if notes[label]:  # a contender that runs, with something to say (a compiled step not CUDA-graphed)
            r.update(note="; ".join(n for n in (r.get("note"), notes[label]) if n))
    return rows


def seeded_twin(label: str) -> str | None:
    """The seeded row a secure row is compared with: reweight-bk-secure -> reweight-bk, noise-secure -> noise-seeded."""
    if label == "noise-secure":
        return "noise-seeded"
    return label.removesuffix("-secure") if label.endswith("-secure") else None


def table(rows: list[dict], device: torch.device) -> pd.DataFrame:
    return pd.DataFrame(rows).reindex(columns=shown_columns(COLUMNS, DEVICE_COLUMNS, device))


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.clip", __doc__, repeats=10, warmup=2, budget=60.0,
                   quick="batches / 8 and 2 repeats: a smoke run of every code path",
                   workloads=workload_names(), out="clip_<device>.csv")
    add_suite_argument(ap)
    ap.add_argument("--methods", default="", help="comma-separated subset of each workload's rows, e.g. "
                    "nonprivate,reweight-bk,reweight-bk-secure,noise-seeded,noise-secure (rng=secure's cost)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"],
                    help="every row's precision= (runner/precision.py; tf32 and bf16 change the CUDA step)")
    ap.add_argument("--compile", default="", help="also time nonprivate and reweight-bk under compile=MODE "
                    "(default | reduce-overhead | cudagraphs; runner/methods/compiled.py)")
    ap.add_argument("--memory-format", default="auto", choices=list(layout.CHOICES),
                    help="every row's memory_format= (runner/memory_format.py; auto: the CPU CNNs measured faster "
                    "so in channels-last, except for methods that need NCHW; make bench-layout compares)")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    repeats = timed_repeats(args)
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, "bench-clip")
    if args.methods:
        wanted = args.methods.split(",")
        unknown = [m for m in wanted if m not in ALL]
        if unknown:
            raise SystemExit(f"bench-clip: unknown method row {unknown[0]!r}; valid: {', '.join(ALL)}")
        chosen = [dataclasses.replace(w, methods=[m for m in w.methods + list(ON_REQUEST) if m in wanted])
                  for w in chosen]
    print(f"[bench-clip] {device_name(device)}, torch {torch.__version__}, {repeats} repeats, median step time")
    rows: list[dict] = []
    for w in chosen:
        print(f"[bench-clip] {w.name}: model={w.model} B={w.batch} ...", flush=True)
        rows += bench_workload(w, device, repeats, args.warmup, args.budget, args.compile, args.precision,
                               args.memory_format)
    df = table(rows, device)
    path = Path(args.out) / f"clip_{device.type}{'_quick' if args.quick else ''}.csv"
    write_csv(path, df.to_dict("records"))
    with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_colwidth", 60,
                           "display.float_format", "{:.2f}".format):
        print(df.to_string(index=False))
    print(f"[bench-clip] memory = peak tensor bytes allocated during one step above those live at its start "
          f"({'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'torch.profiler CPU allocation records'})")
    print(f"[bench-clip] saved {path}")
    return df


if __name__ == "__main__":
    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.clip"))
