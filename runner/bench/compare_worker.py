"""One tree's side of `python -m runner.bench.compare` (runner/bench/compare.py starts one per tree, as a script).

    python runner/bench/compare_worker.py TREE DEVICE      # then JSON lines on stdin, one answer per line on stdout

Imports nothing of the tree it lives in: TREE's own `runner` (its models, methods and bench) builds the contenders,
so each tree is timed with its own code, in its own process, and no module of one tree can reach the other's.
Requests: {"build": workload, "methods": [...], "quick": bool, "suite": "default" | "gpu", "precision": "fp32"...,
"memory_format": "auto"...,
"batch": None | int (the workload's batch replaced)} ->
{"built": [labels], "notes": {label: why not}, "batch": the batch built}; {"step": label} -> {"s": seconds of one step}; {"memory": label} ->
{"bytes": peak bytes of one step, as bench-clip measures it}; {"ops": label} -> {"kernels": computing operators of one
step, not views (~ kernels launched on a GPU: THIS tree's runner/bench/opcount.py counts, loaded by its path, so both
trees are counted alike)}; {"device_time": label} -> {"ms": device time of one step's kernels, "mallocs": its
allocator calls into the driver, nan off CUDA (THIS tree's runner/bench/device_time.py, as for the kernels)}; {"quit": true}. {"step": label} also answers "host_s", the
seconds until the step returned before the device finished it (device_time.host_and_wall, timed alike for both trees).
The tree's bench API: runner.bench.clip's workloads(), gpu_workloads() and method_contender(), runner.bench.common's
synthetic_batch() and step_memory_bytes() (there since the certified-clipping work began; an older tree answers
{"error": ...}).
"""
import importlib.util
import inspect
import json
import sys
from pathlib import Path


def own_module(name: str):
    """runner/bench/<name>.py next to this file, under a name of its own: opcount and device_time import torch only,
    so the tree being measured keeps its own `runner`, and both trees are measured by this tree's code (an older tree
    has neither)."""
    spec = importlib.util.spec_from_file_location(f"compare_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(tree: str, device_name: str) -> None:
    sys.path[0] = tree  # this script's folder (the current tree's runner/bench) out, TREE's root in
    import torch

    from runner.bench import clip, common
    from runner.models import MODELS

    device = torch.device(device_name)
    count_kernels = own_module("opcount").kernels
    device_time = own_module("device_time")
    steps: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "quit" in request:
            break
        try:
            if "build" in request:
                answer = build(clip, common, MODELS, device, request, steps)
            elif "memory" in request:
                c = steps[request["memory"]]
                answer = {"bytes": common.step_memory_bytes(c.step, device, before=c.zero_grad)}
            elif "ops" in request:
                c = steps[request["ops"]]
                answer = {"kernels": count_kernels(c.step, before=c.zero_grad)}
            elif "device_time" in request:
                step = steps[request["device_time"]].step
                answer = {"ms": device_time.kernel_ms(step, device), "mallocs": device_time.mallocs_per_step(step, device)}
            else:
                host_s, wall_s = device_time.host_and_wall(steps[request["step"]].step, device)
                answer = {"s": wall_s, "host_s": host_s}
        except Exception as e:  # the parent notes a build error on the rows, and stops on a step's
            answer = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
        print(json.dumps(answer), flush=True)


def build(clip, common, MODELS, device, request: dict, steps: dict) -> dict:
    """One workload's contenders, as runner.bench.clip builds them (same seed, a fresh model copy per method)."""
    import torch

    suite = clip.gpu_workloads(request["quick"]) if request.get("suite") == "gpu" else clip.workloads(request["quick"])
    workload = [w for w in suite if w.name == request["build"]]
    if not workload:
        return {"error": f"this tree has no workload {request['build']!r}"}
    w = workload[0]
    if request.get("batch"):  # --batch: both trees' workload at this batch (a small one times the host's dispatch)
        import dataclasses

        w = dataclasses.replace(w, batch=int(request["batch"]))
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = common.synthetic_batch(w.info, w.batch, device)
    steps.clear()
    notes = {}
    # a tree older than precision= (runner/precision.py) runs torch's defaults (on CUDA: TF32 convolutions, float32
    # matmuls), and its reply says so
    knows = "precision" in inspect.signature(clip.method_contender).parameters
    precision = {"precision": request.get("precision", "fp32")} if knows else {}
    # a tree older than memory_format= (runner/memory_format.py) runs its models NCHW, and its reply says so
    knows_layout = "memory_format" in inspect.signature(clip.method_contender).parameters
    layout = {"memory_format": request.get("memory_format", "auto")} if knows_layout else {}
    rows = getattr(clip, "ALL", None)  # the rows this tree has (a newer row asked of an older tree is a note)
    for label in request["methods"]:
        if rows is not None and label not in rows:
            notes[label] = f"this tree has no row {label!r}"
            continue
        c, note = clip.method_contender(label, base, x, y, float(w.batch), w.info.train_size, **precision, **layout)
        if c is None:
            notes[label] = note
        else:
            steps[label] = c
    import runner

    return {"built": list(steps), "notes": notes, "runner": runner.__file__,
            "precision": precision.get("precision", "torch's defaults"), "batch": w.batch,
            "memory_format": layout.get("memory_format", "contiguous (no memory_format=)")}


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
