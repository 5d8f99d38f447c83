"""The memory study (Lee & Kifer section 6.7): per method, the largest batch that trains, found directly by doubling
then bisection, one probe per batch size. An out-of-memory ends only its own probe, never the sweep.

    python -m runner.memory_study --scale paper -- device=cuda          # make memory-study SCALE=paper
    python -m runner.memory_study --scale smoke --methods nonprivate,reweight --isolation inprocess -- device=cpu
    python -m runner.memory_study --scale smoke -- memory_study.memory_cap_bytes=11e9   # emulate an 11 GB GPU
    python -m runner.memory_study --dry-run --scale paper               # the probes' dprun overrides only

A probe is one short training run of conf/experiment/lk_memory.yaml (`dprun experiment=lk_memory method=M
batch_size=B`, fixed-size batches) in its own folder, where dprun-report and the figure find it:

    outputs/multirun/lk_memory_study/<stamp>/<method>/b<B>/   summary.json + metrics.csv (runner.train),
                                                              probe.json {method, batch_size, status ok|oom|error,
                                                                          peak_mem_bytes, seconds, error}
    outputs/multirun/lk_memory_study/<stamp>/study.json       per method: largest batch that fit, first that did not

Isolation (`--isolation`, default `subprocess`): each probe runs in its own Python process. That is the robust
choice: a CPU allocation failure on Linux is often no exception at all but the kernel's OOM killer (SIGKILL), which
only a separate process survives; after a CUDA OOM in-process, the exception's traceback frames, the caching
allocator's blocks and fragmentation, and cuDNN/cuBLAS workspaces make a later probe's success and peak depend on
the probes before it; a fresh process measures every batch size from a clean allocator. The cost is a process start
(a few seconds) per probe, small next to a ResNet-101 step, and about 15 probes per method. `inprocess` (fast;
the tests use it) catches the OOM, drops the exception and its frames, then gc.collect() and
torch.cuda.empty_cache() before the next probe.

Search: start at `memory_study.start`, double while the probe fits (up to `memory_study.max_batch`), then bisect
between the largest batch that fit and the smallest that did not until they are `resolution` apart. A probe that
fails for another reason than memory (a bug) ends that method's search with status `error`; the next method runs.

Logical batches (`memory_study.physical_batch_size=P`, issue 20): a second search per method with every logical
batch processed in chunks of P (the same private step), up to max_batch (the training set), into
<stamp>/<method>@P<P>/b<B>/. Its memory does not grow with the logical batch, so the largest logical batch is
expected to be the whole data set; study.json records it as methods[m]["logical"], the figure as a second bar.

Artificial cap (`memory_study.memory_cap_bytes`, or env DPRUN_MEMORY_CAP_BYTES): on CUDA the allocator is limited
to it (torch.cuda.set_per_process_memory_fraction: a real OOM at the cap, e.g. the paper's 11 GB on a larger GPU);
on any device a probe whose measured peak (CUDA: max allocated; CPU: the probe process's peak resident set size,
meaningful with isolation=subprocess) exceeds the cap is recorded as out of memory (torch.OutOfMemoryError).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from runner.entry import OneLineParser, run_entry

STUDY_ROOT = Path("outputs/multirun/lk_memory_study")
EXPERIMENT = "lk_memory"
DEFAULT_METHODS = ("nonprivate", "multiloss", "reweight")
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "memory cap")


@dataclass
class Probe:
    method: str
    batch_size: int
    status: str  # ok | oom | error
    peak_mem_bytes: Optional[int] = None
    seconds: Optional[float] = None
    error: Optional[str] = None
    memory_cap_bytes: Optional[int] = None
    run_dir: Optional[str] = None


@dataclass
class SearchResult:
    largest_ok: Optional[int]  # the largest batch that fit (None: not even the smallest tried)
    first_oom: Optional[int]  # the smallest batch that ran out of memory (None: max_batch fit)
    probes: list  # [Probe] in the order run
    stopped_by_error: bool = False


def search(probe: Callable[[int], Probe], start: int, max_batch: int, resolution: int = 1) -> SearchResult:
    """Largest batch b <= max_batch with probe(b).status == "ok": double from `start` until a probe runs out of
    memory (or max_batch fits), then bisect until the last fit and the first OOM are `resolution` apart. Assumes
    memory grows with the batch (one OOM at b means every batch above b would run out too)."""
    probes: list[Probe] = []
    lo, hi = 0, None  # lo: largest fit (0 = none yet); hi: smallest OOM

    def run(b: int) -> Probe:
        p = probe(b)
        probes.append(p)
        return p

    b = max(1, min(int(start), int(max_batch)))
    while True:
        p = run(b)
        if p.status == "error":
            return SearchResult(lo or None, hi, probes, stopped_by_error=True)
        if p.status != "ok":
            hi = b
            break
        lo = b
        if b >= max_batch:
            return SearchResult(lo, None, probes)
        b = min(2 * b, int(max_batch))
    while hi - lo > max(1, int(resolution)):
        mid = (lo + hi) // 2
        p = run(mid)
        if p.status == "error":
            return SearchResult(lo or None, hi, probes, stopped_by_error=True)
        if p.status == "ok":
            lo = mid
        else:
            hi = mid
    return SearchResult(lo or None, hi, probes)


# --- one probe -------------------------------------------------------------------------------------------------

def is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in OOM_MARKERS)


def probe_overrides(scale: str, method: str, batch_size: int, passthrough: list[str]) -> list[str]:
    return [f"experiment={EXPERIMENT}", f"scale={scale}", f"method={method}", f"batch_size={batch_size}",
            "progress=false", *passthrough]


def memory_cap(cfg) -> Optional[int]:
    env = os.environ.get("DPRUN_MEMORY_CAP_BYTES")
    value = env if env else (cfg.get("memory_study") or {}).get("memory_cap_bytes")
    return int(float(value)) if value not in (None, "", "null") else None


def measured_peak(device, summary: Optional[dict]) -> Optional[int]:
    """The probe's peak memory: CUDA max allocated since the probe began; CPU the process's peak resident set."""
    from runner.metrics import peak_memory_bytes

    if summary and summary.get("final", {}).get("peak_mem_bytes") not in (None, ""):
        return int(summary["final"]["peak_mem_bytes"])
    return peak_memory_bytes(device)


def release(device) -> None:
    """Give back what a probe held, so that the next in-process probe starts from a clean allocator."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def mark_failed(run_dir: Path, error: str) -> None:
    """summary.json says failed (the figure reads it as 'did not fit'), whatever the run itself wrote."""
    from runner.metrics import write_json

    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    if not summary:
        return  # the probe died before train() wrote anything: probe.json alone records it
    summary.update(status="failed", error=error)
    write_json(path, summary)


def probe_inprocess(overrides: list[str], run_dir: Path) -> Probe:
    """One probe in this process: train() at the batch size, OOM caught, everything released afterwards."""
    import torch

    from runner.paths import compose
    from runner.train import resolve_device, train

    cfg = compose([*overrides, f"out_dir={run_dir}"])
    method, batch = str(cfg.method.name), int(cfg.batch_size)
    device = resolve_device(str(cfg.device))
    cap = memory_cap(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        if cap:  # a real allocator limit at the cap
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    result = Probe(method, batch, "ok", memory_cap_bytes=cap, run_dir=str(run_dir))
    start = time.perf_counter()
    summary = None
    try:
        summary = train(cfg, run_dir)
        peak = measured_peak(device, summary)
        if cap and peak is not None and peak > cap:
            raise torch.OutOfMemoryError(f"memory cap: measured peak {peak} B > memory_cap_bytes={cap}")
    except Exception as e:  # noqa: BLE001 - every failure is recorded; the sweep goes on
        result.status = "oom" if is_oom(e) else "error"
        result.error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        if result.status == "error":
            result.error += " | " + "".join(traceback.format_tb(e.__traceback__)[-2:]).replace("\n", " ")[:800]
        traceback.clear_frames(e.__traceback__)  # the frames hold the model, the batch and the activations
        del e
        mark_failed(run_dir, result.error)
    result.seconds = time.perf_counter() - start
    result.peak_mem_bytes = measured_peak(device, summary if result.status == "ok" else None)
    summary = None
    release(device)
    write_probe(run_dir, result)
    return result


def write_probe(run_dir: Path, p: Probe) -> None:
    from runner.metrics import write_json

    write_json(run_dir / "probe.json", asdict(p))


def read_probe(run_dir: Path) -> Optional[Probe]:
    path = run_dir / "probe.json"
    if not path.exists():
        return None
    return Probe(**json.loads(path.read_text()))


def child_command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "runner.memory_study", "--probe", str(run_dir), "--", *overrides]


def probe_subprocess(overrides: list[str], run_dir: Path, method: str, batch: int,
                     timeout: Optional[float] = None) -> Probe:
    """One probe in its own process; a probe killed by the OS (OOM killer: SIGKILL) is recorded as out of memory."""
    start = time.perf_counter()
    try:
        rc = subprocess.call(child_command(run_dir, overrides), timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    result = read_probe(run_dir)
    if result is not None:
        return result
    if rc in (-9, 137):
        status, error = "oom", f"probe process killed by signal 9 (exit {rc}): the kernel's OOM killer, most likely"
    elif rc is None:
        status, error = "error", f"probe timed out after {timeout} s"
    else:
        status, error = "error", f"probe process exited {rc} without writing probe.json"
    result = Probe(method, batch, status, seconds=time.perf_counter() - start, error=error, run_dir=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    mark_failed(run_dir, error)
    write_probe(run_dir, result)
    return result


# --- the study -------------------------------------------------------------------------------------------------

def study_settings(scale: str, passthrough: list[str]) -> dict:
    from runner.paths import compose

    cfg = compose([f"experiment={EXPERIMENT}", f"scale={scale}", *passthrough])
    ms = cfg.get("memory_study") or {}
    physical = ms.get("physical_batch_size")
    return {"methods": list(ms.get("methods") or DEFAULT_METHODS), "start": int(ms.get("start") or 8),
            "max_batch": int(ms.get("max_batch") or 1024), "resolution": int(ms.get("resolution") or 1),
            "physical_batch_size": int(physical) if physical else None,
            "memory_cap_bytes": memory_cap(cfg), "device": str(cfg.device)}


def run_study(scale: str, passthrough: list[str], methods: Optional[list[str]] = None,
              isolation: str = "subprocess", root: Path = STUDY_ROOT, stamp: Optional[str] = None,
              timeout: Optional[float] = None, log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict:
    """Every method's search; returns (and writes to <root>/<stamp>/study.json) the largest batch per method."""
    from runner.metrics import write_json

    settings = study_settings(scale, passthrough)
    methods = list(methods or settings["methods"])
    study_dir = Path(root) / (stamp or time.strftime("%Y-%m-%d_%H-%M-%S"))
    study_dir.mkdir(parents=True, exist_ok=True)
    if isolation == "inprocess" and settings["memory_cap_bytes"] and not settings["device"].startswith("cuda"):
        log("memory_study: note: on the CPU the measured peak is the process's peak RSS, which an in-process "
            "sweep cannot reset; use --isolation subprocess with a memory cap")
    out = {"scale": scale, "isolation": isolation, "overrides": passthrough, **settings, "methods": {}}

    P = settings["physical_batch_size"]
    for method in methods:
        def probe(b: int, method=method, physical=None) -> Probe:
            folder = method if physical is None else f"{method}@P{physical}"
            run_dir = study_dir / folder / f"b{b}"
            overrides = probe_overrides(scale, method, b, passthrough)
            if physical is not None:
                overrides.append(f"physical_batch_size={physical}")
            if isolation == "subprocess":
                p = probe_subprocess(overrides, run_dir, method, b, timeout)
            else:
                p = probe_inprocess(overrides, run_dir)
            peak = f", peak {p.peak_mem_bytes / 2**20:.0f} MiB" if p.peak_mem_bytes else ""
            log(f"memory_study: {folder} B={b}: {p.status}{peak}" + (f" ({p.error})" if p.error else ""))
            return p

        found = search(probe, settings["start"], settings["max_batch"], settings["resolution"])
        out["methods"][method] = {"largest_ok": found.largest_ok, "first_oom": found.first_oom,
                                  "stopped_by_error": found.stopped_by_error,
                                  "probes": [asdict(p) for p in found.probes]}
        log(f"memory_study: {method}: largest batch that fit {found.largest_ok}, first out of memory "
            f"{found.first_oom}" + (" (stopped by an error)" if found.stopped_by_error else ""))
        if P:  # the same method with logical batches in chunks of P: up to the whole training set
            logical = search(lambda b, method=method: probe(b, method, P), max(P, settings["start"]),
                             settings["max_batch"], settings["resolution"])
            out["methods"][method]["logical"] = {
                "physical_batch_size": P, "largest_ok": logical.largest_ok, "first_oom": logical.first_oom,
                "stopped_by_error": logical.stopped_by_error, "probes": [asdict(p) for p in logical.probes]}
            log(f"memory_study: {method} at physical_batch_size={P}: largest logical batch that fit "
                f"{logical.largest_ok} (the training set: {settings['max_batch']})")
        write_json(study_dir / "study.json", out)  # after every method: a killed study keeps what it found
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = OneLineParser(prog="python -m runner.memory_study", description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="smoke", choices=["smoke", "paper"])
    p.add_argument("--methods", help="comma-separated (default: the preset's memory_study.methods)")
    p.add_argument("--isolation", default="subprocess", choices=["subprocess", "inprocess"])
    p.add_argument("--root", default=str(STUDY_ROOT), help="where the study folder goes (dprun-report reads it)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per probe (subprocess isolation)")
    p.add_argument("--dry-run", action="store_true", help="print the first probe of each method, run nothing")
    p.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run one probe in this process into this folder
    args = p.parse_args(argv)
    if args.probe:
        result = probe_inprocess(passthrough, Path(args.probe))
        return 0 if result.status in ("ok", "oom") else 3
    if args.dry_run:
        s = study_settings(args.scale, passthrough)
        for method in (args.methods.split(",") if args.methods else s["methods"]):
            print("memory_study: dprun " + " ".join(probe_overrides(args.scale, method, s["start"], passthrough)))
        print(f"memory_study: then doubling up to {s['max_batch']} and bisection to {s['resolution']}")
        return 0
    run_study(args.scale, passthrough, args.methods.split(",") if args.methods else None, args.isolation,
              Path(args.root), timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(run_entry(main, "python -m runner.memory_study"))
