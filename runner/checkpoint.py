"""Checkpoint and resume: `dprun ... resume=<run dir>` continues a run where its last finished epoch left it.

    dprun method=reweight epochs=20            # writes <run dir>/checkpoint.pt after every epoch
    dprun resume=outputs/runs/.../<run dir>    # same overrides (read from <run dir>/.hydra/overrides.yaml), same folder
    dprun resume=<run dir> epochs=40           # ... and train on to epoch 40

The checkpoint holds what the next epoch depends on, as plain tensors, dicts and lists (loaded with
`torch.load(weights_only=True)`, so a checkpoint cannot run code): the model's and optimizer's state, the sampler's
generator (and fixed batches), torch's global RNG (noise, dropout), the method's sigma, every step the accountant was
told (mechanism class, fields, count, in order) and the metrics rows so far. A resumed run therefore continues with
the same batches, the same noise and the same epsilon as one that was never interrupted (tests/test_checkpoint.py).
The file is replaced atomically once per epoch; a run killed mid-epoch resumes from its last finished epoch.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import torch
import yaml

from runner.accountants.mechanisms import Mechanism
from runner.errors import DprunError
from runner.metrics import atomic_replace

FILE = "checkpoint.pt"
# keys that may differ between the interrupted run and its resumption (everything else must match)
MAY_CHANGE = ("epochs", "resume", "out_dir", "progress", "eval_batch_size", "max_eval_batches", "checkpoint")


def supported(method) -> str | None:
    """None if the method's whole state is in the model and optimizer; else why it cannot be resumed."""
    return method.not_resumable


def _mechanism_classes() -> dict[str, type]:
    out, todo = {}, [Mechanism]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo += cls.__subclasses__()
    return out


def accountant_steps(accountant) -> list[tuple[Mechanism, int]]:
    """The steps in the order the accountant was told them, run-length encoded."""
    if accountant is None:
        return []
    sequence = getattr(accountant, "sequence", None)  # hsa: the order matters
    if sequence is None:
        return list(accountant.history.items())
    steps: list[list] = []
    for m in sequence:
        if steps and steps[-1][0] == m:
            steps[-1][1] += 1
        else:
            steps.append([m, 1])
    return [(m, n) for m, n in steps]


def save(out_dir: str | Path, *, epoch: int, model, optimizer, sampler, method, accountant, rows: list[dict]) -> None:
    state = {
        "epoch": int(epoch),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler_rng": sampler.generator.get_state(),
        "sampler_fixed": list(sampler._fixed) if sampler._fixed is not None else None,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "sigma": float(method.sigma),
        "accountant": [{"mechanism": type(m).__name__, "fields": dataclasses.asdict(m), "count": int(n)}
                       for m, n in accountant_steps(accountant)],
        "rows": [dict(r) for r in rows],
    }
    path = Path(out_dir) / FILE
    atomic_replace(path, lambda tmp: torch.save(state, tmp))  # a signal mid-save leaves no temp file


def load(run_dir: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The saved state; mmap=True maps the tensors instead of reading them (a cheap check that the file is whole)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise DprunError(f"resume={run_dir}: no {FILE} there (runs save one after each finished epoch)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # cut short (a full disk, a copy
        # stopped half-way) or overwritten: torch's error is a many-line traceback that does not say which file
        raise DprunError(f"{path} is damaged or truncated ({str(e).splitlines()[0][:80]}); the run's metrics.csv "
                         "and summary.json are intact, but it cannot be resumed: run it again for more epochs") from e


def saved_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DprunError(f"resume={run_dir}: no readable summary.json there ({type(e).__name__}); "
                         "resume= takes the folder of a run dprun wrote") from e
    if not isinstance(summary, dict) or not isinstance(summary.get("config"), dict):
        raise DprunError(f"resume={run_dir}: its summary.json holds no run config")
    return summary


def nothing_to_train(run_dir: str | Path, done: int, epochs: int) -> bool:
    """True if the run already has `epochs` epochs. Fewer is refused: the loop would train nothing and the records
    would call a run with `done` epochs an `epochs`-epoch run."""
    if epochs < done:
        raise DprunError(f"resume={run_dir}: the run has completed {done} epochs, more than epochs={epochs}; "
                         f"a resume trains on (epochs > {done}), it cannot shorten a run")
    return epochs == done


def check_config(run_dir: str | Path, cfg: dict) -> None:
    """The resumed run must be the same run: every key but MAY_CHANGE equals the saved summary.json's config."""
    summary = Path(run_dir) / "summary.json"
    if not summary.is_file():
        return
    saved = json.loads(summary.read_text()).get("config", {})
    cfg = json.loads(json.dumps(cfg, default=str))  # as summary.json holds it: tuples as lists
    differ = sorted(k for k in set(saved) | set(cfg) if k not in MAY_CHANGE and saved.get(k) != cfg.get(k))
    if differ:
        shown = ", ".join(f"{k}={saved.get(k)!r} -> {cfg.get(k)!r}" for k in differ[:4])
        raise DprunError(f"resume={run_dir}: the run's config differs ({shown}); only {', '.join(MAY_CHANGE[:2])} "
                         "and logging options may change on resume")


def restore(state: dict[str, Any], *, model, optimizer, sampler, method, accountant) -> tuple[int, list[dict]]:
    """Loads the state into the freshly built objects; returns (last finished epoch, metrics rows so far)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.generator.set_state(state["sampler_rng"])
    if state["sampler_fixed"] is not None:
        sampler._fixed = [t.to(sampler.device) for t in state["sampler_fixed"]]
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    method.sigma = float(state["sigma"])
    if accountant is not None:
        classes = _mechanism_classes()
        for step in state["accountant"]:
            accountant.step(classes[step["mechanism"]](**step["fields"]), count=int(step["count"]))
    return int(state["epoch"]), list(state["rows"])


def resume_argv(argv: list[str]) -> list[str]:
    """`dprun resume=<dir> [k=v ...]`: the run's own overrides (its .hydra/overrides.yaml) first, the command line's
    on top, and Hydra's run folder set to <dir> so the run continues in place."""
    run_dir = next((a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("resume=")), None)
    if not run_dir or "-m" in argv or "--multirun" in argv:
        return argv
    run_dir = str(Path(run_dir).expanduser().resolve())
    saved_file = Path(run_dir) / ".hydra" / "overrides.yaml"
    saved = yaml.safe_load(saved_file.read_text()) if saved_file.is_file() else []
    key = lambda o: o.lstrip("+~").split("=", 1)[0]
    given = {key(a) for a in argv if "=" in a}
    keep = [o for o in saved or [] if key(o) not in given and key(o) not in ("resume", "hydra.run.dir")]
    rest = [a if not a.lstrip("+").startswith("resume=") else f"resume={run_dir}" for a in argv]
    return keep + rest + [f"hydra.run.dir={run_dir}"]
