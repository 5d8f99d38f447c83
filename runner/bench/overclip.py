"""What certified clipping costs in exactness on ordinary data: certified norm / exact norm, per paper model.

The certified norm N_i (runner/norms/certify.py) bounds the float32 rounding worst case, so on ordinary inputs it
sits slightly above the exact norm and a clipped example gets a factor C / N_i a little below nxBP's C / ||g_i||.
This measures by how much: reweight's norms in float32 (each mode) against nxBP's in float64 on a float64 copy of
the same model and batch (synthetic inputs of the dataset's shape, as the benches use; with --data-dir, real
training examples: real inputs repeat - MNIST's blank rows, IMDB's common tokens - where a ghost Gram can cancel).

    python -m runner.bench.overclip                 # every paper model of the GPU suite at B = 16 (CPU, ~1 min)
    python -m runner.bench.overclip --batch 8 --workloads cnn_mnist,lstm_mnist
    python -m runner.bench.overclip --data-dir ../shared/data --batch 64   # MNIST and IMDB workloads on real batches
"""
from __future__ import annotations

import copy

import torch

from runner.bench.clip import gpu_workloads, workloads
from runner.bench.common import loss_fn, synthetic_batch
from runner.entry import OneLineParser
from runner.errors import DprunError
from runner.methods import METHODS
from runner.models import MODELS

MODES = ("bk", "twopass", "recompute")


def norms(name: str, cfg: dict, model: torch.nn.Module, x, y) -> torch.Tensor:
    """(B,) the per-example norms the method clips by (sigma = 0, lr = 0: nothing moves)."""
    method = METHODS.build(name, cfg=cfg, clip=1e-3, sigma=0.0)
    model = method.attach(copy.deepcopy(model))
    out = method.step(model, loss_fn, x, y, torch.optim.SGD(model.parameters(), lr=0.0), sample_rate=0.01,
                      expected_batch_size=float(len(y)))
    return out.norms.detach().double()


def real_batch(info, batch: int, data_dir: str, loaded: dict):
    """`batch` training examples of the workload's dataset (the same seeded draw for every workload), read from
    data_dir as a run reads them (conf/dataset/<name>.yaml's defaults)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from runner.data import load_dataset

    if info.name not in loaded:
        cfg = OmegaConf.load(Path(__file__).parents[1] / "conf" / "dataset" / f"{info.name}.yaml").dataset
        loaded[info.name] = load_dataset(cfg, data_dir)
    data = loaded[info.name]
    if tuple(data.info.input_shape) != tuple(info.input_shape) or data.info.vocab_size != info.vocab_size:
        raise DprunError(f"overclip --data-dir: {info.name} in {data_dir} has inputs {data.info.input_shape} (vocabulary "
                         f"{data.info.vocab_size}), the workload's model expects {info.input_shape} ({info.vocab_size})")
    rows = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(0))[:batch]
    return data.train_x[rows], data.train_y[rows]


def main(argv=None):
    import pandas as pd

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workloads", default=None, help="comma-separated names (default: every paper model)")
    parser.add_argument("--data-dir", default=None, help="real batches: training examples of each workload's dataset "
                        "from this folder (a workload whose dataset is not there is skipped, with the reason)")
    args = parser.parse_args(argv)
    chosen = {w.name: w for w in workloads() + gpu_workloads() if w.model != "resnet101"}
    if args.workloads:
        chosen = {k: chosen[k] for k in args.workloads.split(",")}
    rows, loaded = [], {}
    for w in chosen.values():
        torch.manual_seed(0)
        model = MODELS.build(w.model, w.info, **w.model_kwargs)
        if args.data_dir:
            try:
                x, y = real_batch(w.info, args.batch, args.data_dir, loaded)
            except DprunError as e:  # that dataset is not in data_dir: the others are still measured
                print(f"[overclip] {w.name}: skipped ({e})", flush=True)
                continue
        else:
            x, y = synthetic_batch(w.info, args.batch, torch.device("cpu"))
        exact = norms("nxbp", {}, model.double(), x.double() if x.is_floating_point() else x, y)
        model = model.float()
        for mode in MODES:
            ratio = norms("reweight", {"mode": mode}, model, x.float() if x.is_floating_point() else x, y) / exact
            rows.append(dict(workload=w.name, model=w.model, data="real" if args.data_dir else "synthetic", mode=mode,
                             median_over=float(ratio.median() - 1),
                             max_over=float(ratio.max() - 1), min_ratio=float(ratio.min())))
            print(f"[overclip] {w.name} {mode}: max {rows[-1]['max_over']:.3g} over", flush=True)
    table = pd.DataFrame(rows).drop_duplicates(["model", "mode"])
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return table


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.overclip"))
