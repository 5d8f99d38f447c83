"""`import dprun`: the library API (runner/api.py) under the project's name. The CLI is `dprun` (runner/cli.py).

    import dprun
    private = dprun.make_private(model, optimizer, (x, y), method="reweight", noise_multiplier=1.0,
                                 max_grad_norm=1.0, batch_size=64)

docs/api.md has a runnable example.
"""
from runner import __version__  # noqa: F401
from runner.api import PoissonBatchSampler, PrivateTraining, make_private, poisson_loader  # noqa: F401

__all__ = ["make_private", "poisson_loader", "PoissonBatchSampler", "PrivateTraining", "__version__"]
