"""Independent check of private IMDB training: Opacus's own pipeline (make_private, its DPLSTM, a Poisson
DataLoader, Adam) on the same token tensors dprun trains on. See docs/imdb_reproduction.md.

    python docs/opacus_imdb_check.py --data-dir /data --epochs 4                 # private, sigma 0.6, C 1, B 256
    python docs/opacus_imdb_check.py --data-dir /data --epochs 3 --nonprivate
    python docs/opacus_imdb_check.py --synthetic --epochs 1                      # seconds: does it run at all

Model: Embedding(V, 64) -> BiLSTM(64) (Opacus DPLSTM: PyTorch's two biases per gate, 512 parameters more than
dprun's Keras-style bilstm) -> Dense(64, ReLU) -> Dense(2), with Keras's initialisers as dprun's bilstm (--init).
The token tensors come from dprun's loader with its defaults (the last 150 tokens, zeros in front). Prints per epoch: train loss, test accuracy, epsilon.
Compare with `dprun dataset=imdb method=reweight` (or method=nonprivate) at the same settings.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class BiLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int = 64, hidden: int = 64, dense: int = 64, classes: int = 2):
        from opacus.layers import DPLSTM

        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = DPLSTM(embed, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Sequential(nn.Linear(2 * hidden, dense), nn.ReLU(), nn.Linear(dense, classes))

    def keras_init_(self):
        """Mirror dprun's bilstm default (model.init=keras): embedding U(+-0.05), Glorot-uniform input and Dense
        kernels, orthogonal recurrent kernels, zero biases with forget-gate bias 1 (in the input bias only)."""
        h = self.lstm.hidden_size
        nn.init.uniform_(self.embed.weight, -0.05, 0.05)
        for name, p in self.lstm.named_parameters():
            if "weight_ih" in name:
                nn.init.xavier_uniform_(p)
            elif "weight_hh" in name:
                nn.init.orthogonal_(p)
            elif "bias" in name:
                nn.init.zeros_(p)
                if "bias_ih" in name:
                    with torch.no_grad():
                        p[h:2 * h] = 1.0
        for layer in self.head:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
        return self

    def forward(self, x):
        _, (h, _) = self.lstm(self.embed(x))  # h: (2, B, hidden), last state of each direction
        return self.head(torch.cat([h[0], h[1]], dim=1))


def load(args, device):
    from runner.data import load_dataset
    from runner.paths import compose

    if args.synthetic:
        cfg = compose(["dataset=synthetic", "dataset.like=imdb", "dataset.train_size=512", "dataset.test_size=256"])
    else:
        cfg = compose(["dataset=imdb", f"data_dir={args.data_dir}"])
    return load_dataset(cfg.dataset, cfg.data_dir, device)


def main(argv=None) -> int:
    from opacus import PrivacyEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir")
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--nonprivate", action="store_true")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--accountant", default="prv", help="Opacus accountant: prv | rdp | gdp")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("keras", "torch"), default="keras", help="as dprun's model.init (bilstm: keras)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    data = load(args, "cpu")
    train = torch.utils.data.TensorDataset(data.train_x, data.train_y)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    model = BiLSTM(data.info.vocab_size)
    if args.init == "keras":
        model.keras_init_()
    model = model.to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = None
    if not args.nonprivate:
        engine = PrivacyEngine(accountant=args.accountant)
        model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                       noise_multiplier=args.sigma, max_grad_norm=args.clip,
                                                       poisson_sampling=True)
    print(f"opacus check: {'non-private' if args.nonprivate else 'private'} | N={len(train)} | "
          f"{sum(p.numel() for p in model.parameters())} parameters | {args}", flush=True)
    for epoch in range(1, args.epochs + 1):
        model.train()
        start, loss_sum, seen = time.time(), 0.0, 0
        for x, y in loader:
            if len(y) == 0:
                continue
            x, y = x.to(args.device), y.to(args.device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(data.test_y), 1024):
                out = model(data.test_x[i:i + 1024].to(args.device))
                correct += (out.argmax(1).cpu() == data.test_y[i:i + 1024]).sum().item()
        eps = engine.get_epsilon(args.delta) if engine else float("nan")
        print(f"epoch {epoch}: train_loss {loss_sum / max(seen, 1):.4f} test_acc {correct / len(data.test_y):.4f} "
              f"epsilon {eps:.3f} ({time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
