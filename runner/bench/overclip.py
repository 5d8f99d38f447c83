"""What certified clipping costs in exactness on ordinary data: certified norm / exact norm, per paper model.

The certified norm N_i (runner/norms/certify.py) bounds the float32 rounding worst case, so on ordinary inputs it
sits slightly above the exact norm and a clipped example gets a factor C / N_i a little below nxBP's C / ||g_i||.
This measures by how much: reweight's norms in float32 (each mode) against nxBP's in float64 on a float64 copy of
the same model and batch, and against nxBP's in float32 (the per-example gradients the float32 model computes, which
the certificate bounds: min_ratio_f32 >= 1 always), on the same batch (synthetic inputs of the dataset's shape, as the benches use; with --data-dir, real
training examples: real inputs repeat - MNIST's blank rows, IMDB's common tokens - where a ghost Gram can cancel).

    python -m runner.bench.overclip                 # every paper model of the GPU suite at B = 16 (CPU, ~1 min)
    python -m runner.bench.overclip --batch 8 --workloads cnn_mnist,lstm_mnist
    python -m runner.bench.overclip --data-dir ../shared/data --batch 64   # MNIST and IMDB workloads on real batches
    python -m runner.bench.overclip --data-dir ../shared/data --batch 64 --train-steps 300   # after some training
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


def trained(model: torch.nn.Module, data, steps: int) -> tuple[float, float]:
    """`steps` non-private Adam steps (lr 1e-3, batches of 64) on the training split, in place: weights as a run has
    them after some training, where per-example gradients shrink and a Gram may cancel more. (first, last) loss."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, len(data.train_y), (64,), generator=g)
        opt.zero_grad()
        loss = loss_fn(model(data.train_x[rows]), data.train_y[rows]).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def main(argv=None):
    import pandas as pd

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workloads", default=None, help="comma-separated names (default: every paper model)")
    parser.add_argument("--data-dir", default=None, help="real batches: training examples of each workload's dataset "
                        "from this folder (a workload whose dataset is not there is skipped, with the reason)")
    parser.add_argument("--train-steps", type=int, default=0, help="with --data-dir: first train each model for this "
                        "many non-private Adam steps on its training split, then measure (default 0: at initialisation)")
    args = parser.parse_args(argv)
    if args.train_steps and not args.data_dir:
        raise DprunError(f"overclip --train-steps {args.train_steps} needs --data-dir: training on synthetic inputs "
                         f"would not give a trained model's weights")
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
            if args.train_steps:
                first, last = trained(model, loaded[w.info.name], args.train_steps)
                print(f"[overclip] {w.name}: {args.train_steps} training steps, loss {first:.3f} -> {last:.3f}", flush=True)
        else:
            x, y = synthetic_batch(w.info, args.batch, torch.device("cpu"))
        exact = norms("nxbp", {}, model.double(), x.double() if x.is_floating_point() else x, y)
        model = model.float()
        x = x.float() if x.is_floating_point() else x
        # nxbp in float32: the norms of the per-example gradients the float32 model computes, which is what a
        # certificate bounds; they differ from the float64 model's where the float32 forward itself rounds (an
        # example the trained model fits: its gradient ~1e-4 is 1 - p, rounded in float32 to a few percent)
        exact32 = norms("nxbp", {}, model, x, y)
        for mode in MODES:
            certified = norms("reweight", {"mode": mode}, model, x, y)
            ratio, ratio32 = certified / exact, certified / exact32
            rows.append(dict(workload=w.name, model=w.model, data="real" if args.data_dir else "synthetic",
                             trained_steps=args.train_steps, mode=mode,
                             median_over=float(ratio.median() - 1),
                             max_over=float(ratio.max() - 1), min_ratio=float(ratio.min()),
                             max_over_f32=float(ratio32.max() - 1), min_ratio_f32=float(ratio32.min())))
            print(f"[overclip] {w.name} {mode}: max {rows[-1]['max_over']:.3g} over (float32 nxbp: "
                  f"{rows[-1]['max_over_f32']:.3g})", flush=True)
    table = pd.DataFrame(rows).drop_duplicates(["model", "mode"])
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return table


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.overclip"))
