"""Checkpoint and resume: `dprun ... resume=<run dir>` continues a run where its last finished epoch left it.

    dprun method=reweight epochs=20            # writes <run dir>/checkpoint.pt after every epoch
    dprun resume=outputs/runs/.../<run dir>    # the run's own config (its summary.json), in the same folder
    dprun resume=<run dir> epochs=40           # ... and train on to epoch 40

The checkpoint holds what the next epoch depends on, as plain tensors, dicts and lists (loaded with
`torch.load(weights_only=True)`, so a checkpoint cannot run code): the model's and optimizer's state, the sampler's
generator (and fixed batches), torch's global RNG (noise, dropout), the method's sigma, every step the accountant was
told (mechanism class, fields, count, in order) and the metrics rows so far. A resumed run therefore continues with
the same batches, the same noise and the same epsilon as one that was never interrupted (tests/test_checkpoint.py).
Under rng=secure no random state is saved (the key never leaves the process, runner/randomness.py): a resumed run
continues with the same model, optimizer and epsilon, and fresh entropy for its batches and noise.
The file is replaced atomically once per epoch; a run killed mid-epoch resumes from its last finished epoch.
What the run published (metrics.csv's rows, summary.json's epochs_completed) decides, not the checkpoint: one epoch
fewer (stopped between the save and metrics.csv) is published from the checkpoint's rows; more is refused
(check_published: a resume would train published epochs again). A resume with checkpoint=false deletes the
checkpoint before it publishes an epoch (runner/train.py, record_epoch), so it never falls behind.

A checkpoint carries its run's id, the one in summary.json: a resume takes only its own run's checkpoint
(check_run_id), and a folder holding a checkpoint.pt takes no new run (runner/run_dir.py; review 42).

The run's config comes from its summary.json (the resolved config it ran with), not from Hydra's .hydra/ record:
every folder dprun writes has one (out_dir= runs have no .hydra/; a sweep job's folder name holds `=` and `,`,
which Hydra's override parser rejects). Only MAY_CHANGE keys may differ, and a resume is refused, or found to have
nothing to train, before anything is written into the run's folder (resume_argv runs before Hydra starts).
"""
from __future__ import annotations

import csv
import dataclasses
import errno
import json
import math
import pickle
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from runner.accountants.mechanisms import Mechanism
from runner.errors import DprunError, RunComplete  # noqa: F401  (RunComplete: raised here, defined with the errors)
from runner.metrics import atomic_replace
from runner.randomness import is_secure

FILE = "checkpoint.pt"
# keys that may differ between the interrupted run and its resumption (everything else must match)
MAY_CHANGE = ("epochs", "resume", "out_dir", "progress", "eval_batch_size", "max_eval_batches", "checkpoint",
              "physical_batch_size", "distributed")  # the last two: how a step is processed, not what it releases


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


def new_run_id() -> str:
    """A fresh run's identity, written to its summary.json and every checkpoint.pt it saves."""
    return secrets.token_hex(16)


def save(out_dir: str | Path, *, epoch: int, model, optimizer, sampler, method, accountant, rows: list[dict],
         run_id: str | None = None) -> None:
    state = {
        "run_id": run_id,
        "epoch": int(epoch),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler_rng": sampler.generator.get_state(),
        "sampler_fixed": list(sampler._fixed) if sampler._fixed is not None else None,
        **({"torch_rng": None, "cuda_rng": []} if is_secure(sampler.generator) else {  # secure: torch's RNG holds a
            "torch_rng": torch.get_rng_state(),  # secret seed (JL directions): not written either
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else []}),
        "sigma": float(method.sigma),
        "accountant": [{"mechanism": type(m).__name__, "fields": dataclasses.asdict(m), "count": int(n)}
                       for m, n in accountant_steps(accountant)],
        "rows": [dict(r) for r in rows],
    }
    path = Path(out_dir) / FILE
    atomic_replace(path, lambda tmp: _torch_save(state, tmp, path))  # a signal mid-save leaves no temp file


def _torch_save(state: dict, tmp: Path, path: Path) -> None:
    """torch.save, whose failed write (a full disk) is a RuntimeError from its zip writer ("enforce fail at
    inline_container.cc", "basic_ios::clear") naming no file: an OSError naming the checkpoint instead."""
    try:
        torch.save(state, tmp)
    except RuntimeError as e:
        free = shutil.disk_usage(tmp.parent).free
        full = free < max(_tensor_bytes(state), 1 << 20)
        what = f"No space left on device ({free} bytes free)" if full else \
            f"Write failed (torch.save: {first_sentence(str(e), 150)}; {free} bytes free)"
        raise OSError(errno.ENOSPC if full else errno.EIO, what, str(path)) from e


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def first_sentence(text: str, limit: int = 100) -> str:
    """The first sentence of an error's first line, cut at a word (never mid-word) if longer than `limit`."""
    line = (text.strip().splitlines() or [""])[0]
    sentence = re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0]
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def load(run_dir: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The saved state; mmap=True maps the tensors instead of reading them (a cheap check that the file is whole)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise DprunError(f"resume={run_dir}: no {FILE} there (runs save one after each finished epoch)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # cut short (a full disk, a copy
        # stopped half-way) or overwritten: torch's error is a many-line traceback that does not say which file
        raise DprunError(f"{path} is damaged or truncated ({first_sentence(str(e))}); the run's metrics.csv "
                         "and summary.json are intact, but it cannot be resumed: run it again for more epochs") from e


def check_run_id(run_dir: str | Path, state: dict[str, Any]) -> str:
    """The run id summary.json and checkpoint.pt share, or DprunError: a checkpoint of another run (left in a folder
    whose results were cleared, or copied in to warm-start) would be resumed as this run, its model and steps with
    this run's records: a non-private run's checkpoint so published an epsilon without its 44 unnoised steps (review
    42). Runs from before run ids have neither, and resume as before. Returns the id the resumed run keeps."""
    ours, theirs = saved_summary(run_dir).get("run_id"), state.get("run_id")
    if ours != theirs:
        raise DprunError(f"resume={run_dir}: its {FILE} belongs to another run than its summary.json (run id "
                         f"{theirs or 'none'}, summary.json's {ours or 'none'}), so it cannot be resumed as this run: "
                         f"start a new run in a fresh out_dir")
    return ours or new_run_id()


ROW_KEYS = ("train_loss", "test_acc", "epsilon")  # what check_rows compares of each published epoch


def check_rows(run_dir: str | Path, state: dict[str, Any]) -> None:
    """The checkpoint's records of the epochs metrics.csv published are those rows, or DprunError: a checkpoint of
    another run swapped in, where no run id tells them apart (runs written before stop 64), would be resumed as this
    one (review 45: a non-private run's checkpoint in a private run's folder published epsilon 1.849 for a model
    behind 44 unnoised steps). Compared: each published epoch's train_loss, test_acc and epsilon (csv keeps repr)."""
    saved = {int(r["epoch"]): r for r in state.get("rows", [])}
    try:
        with open(Path(run_dir) / "metrics.csv", newline="") as f:
            published = list(csv.DictReader(f))
    except FileNotFoundError:
        return

    def same(cell: str | None, value: Any) -> bool:
        a = float(cell) if cell not in (None, "") else math.nan
        b = float(value) if value not in (None, "") else math.nan
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)

    for row in published:
        epoch = int(float(row["epoch"]))
        mine = saved.get(epoch)
        if mine is None or not all(same(row.get(k), mine.get(k)) for k in ROW_KEYS if k in row):
            raise DprunError(f"resume={run_dir}: its {FILE} does not hold the epochs metrics.csv published (epoch "
                             f"{epoch} differs), so it belongs to another run and cannot be resumed as this one: "
                             f"start a new run in a fresh out_dir")


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


def finished(run_dir: str | Path) -> bool:
    """summary.json says the run finished. A run stopped after publishing its last epoch (its checkpoint's epoch,
    published as it stopped: train.publish_saved_epoch) has every epoch but not its end (status finished, the
    audit): a resume trains nothing and finishes it."""
    return saved_summary(run_dir).get("status") == "finished"


def published_epochs(run_dir: str | Path) -> int:
    """The epochs the run has published: metrics.csv's rows or summary.json's epochs_completed, whichever is more
    (a SIGKILLed resume leaves a summary.json without epochs_completed; metrics.csv is replaced atomically)."""
    run_dir = Path(run_dir)
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = max((int(float(r["epoch"])) for r in csv.DictReader(f)), default=0)
    except FileNotFoundError:
        rows = 0
    except (OSError, ValueError, KeyError, TypeError, csv.Error) as e:
        raise DprunError(f"resume={run_dir}: its metrics.csv cannot be read ({type(e).__name__}), so what the run "
                         "published is unknown; it cannot be resumed") from e
    try:
        summary = int(saved_summary(run_dir).get("epochs_completed") or 0)
    except (DprunError, ValueError, TypeError):
        summary = 0
    return max(rows, summary)


def check_published(run_dir: str | Path, saved_epoch: int) -> int:
    """published_epochs(run_dir), refused (DprunError) if more than the checkpoint's epoch: the resume would train
    published epochs again (checkpoint=false on an earlier resume, or a checkpoint put back from a copy), and under
    rng=secure with fresh noise: a second release of those epochs, accounted once. Fewer (by one: a stop between the
    checkpoint's save and metrics.csv) is fine: the resume publishes them from the checkpoint's rows."""
    published = published_epochs(run_dir)
    if published > saved_epoch:
        raise DprunError(f"resume={run_dir}: the run published {published} epochs (metrics.csv, summary.json) but "
                         f"its {FILE} holds epoch {saved_epoch}; resuming would train published epochs again (a "
                         f"second release of them), so it cannot be resumed: start a new run for more epochs")
    return published


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
        may_change = ", ".join(k for k in MAY_CHANGE if k not in SET_BY_RESUME)
        raise DprunError(f"resume={run_dir}: the run's config differs ({shown}); only {may_change} may change on "
                         f"resume")
    if saved.get("target_epsilon") is not None and saved.get("epochs") != cfg.get("epochs"):
        # sigma was calibrated so that epsilon after the saved epochs meets the target; the resume restores that
        # sigma (restore), so more epochs would spend more than the target the run's records say was met
        raise DprunError(f"resume={run_dir}: the run calibrated sigma to target_epsilon={saved['target_epsilon']} "
                         f"over epochs={saved.get('epochs')}, so epochs cannot change on resume (epochs="
                         f"{cfg.get('epochs')} would exceed that target); start a new run for a longer one")


def restore(state: dict[str, Any], *, model, optimizer, sampler, method, accountant) -> tuple[int, list[dict]]:
    """Loads the state into the freshly built objects; returns (last finished epoch, metrics rows so far)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.generator.set_state(state["sampler_rng"])
    if state["sampler_fixed"] is not None:
        sampler._fixed = [t.to(sampler.device) for t in state["sampler_fixed"]]
    if state["torch_rng"] is not None and not is_secure(sampler.generator):  # secure: fresh entropy, not replay
        torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    method.sigma = float(state["sigma"])
    if accountant is not None:
        classes = _mechanism_classes()
        for step in state["accountant"]:
            accountant.step(classes[step["mechanism"]](**step["fields"]), count=int(step["count"]))
    return int(state["epoch"]), list(state["rows"])


RESUME_CONFIG = "dprun_resume"  # Hydra's primary config for a resumed run, kept in Hydra's ConfigStore
SET_BY_RESUME = ("resume", "out_dir")  # MAY_CHANGE keys the resume sets: the run goes on in its own folder


def resume_argv(argv: list[str]) -> list[str]:
    """`dprun resume=<dir> [k=v ...]` -> Hydra's argv for the run continued in <dir>, before Hydra starts.

    The config is resumed_config()'s, stored as Hydra's primary config (RESUME_CONFIG) rather than passed as
    overrides, so Hydra parses neither the folder's name nor the run's values. Hydra's run folder is <dir> with no
    .hydra/ output: Hydra rewrites .hydra/ before dprun's code runs, and it is the run's record of how it was
    launched. Raises DprunError (refused) or RunComplete before anything is written. Flags (--cfg job) pass on."""
    at = _resume_at(argv)
    if at is None:
        return argv
    run_dir, rest = _folder(argv[at].split("=", 1)[1]), argv[:at] + argv[at + 1:]
    if {"-m", "--multirun"} & set(rest):
        raise DprunError("resume= continues one run: leave out -m (resume each job's folder on its own)")
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    cfg = resumed_config(run_dir, overrides)
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=RESUME_CONFIG, node={
        "defaults": [{"override hydra/job_logging": "disabled"}, "_self_"], **cfg,  # as conf/config.yaml's
        "hydra": {"run": {"dir": str(run_dir)}, "output_subdir": None, "job": {"chdir": False}}})
    return [a for a in rest if a not in overrides] + [f"--config-name={RESUME_CONFIG}"]


def _resume_at(argv: list[str]) -> int | None:
    """The index of a resume=<dir> argument (not resume=null), or None."""
    at = next((i for i, a in enumerate(argv) if a.lstrip("+").startswith("resume=")), None)
    return None if at is None or argv[at].split("=", 1)[1] in ("", "null") else at


def resume_folder(argv: list[str]) -> Path | None:
    """The folder of the command line's resume=<dir>, or None (runner/launch.py: how many ranks it ran on)."""
    at = _resume_at(argv)
    return None if at is None else _folder(argv[at].split("=", 1)[1])


def _folder(value: str) -> Path:
    """resume='s folder. dprun reads it before Hydra, so a sweep job's `0_model=cnn,seed=1` needs no quoting or
    escape; a value quoted or escaped the way Hydra's grammar asks is understood too."""
    for candidate in (value, value.strip("'\""), re.sub(r"\\(.)", r"\1", value)):
        if Path(candidate).expanduser().is_dir():
            return Path(candidate).expanduser().resolve()
    raise DprunError(f"resume={value}: no such folder (resume= takes the folder of a run dprun wrote)")


def resumed_config(run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """The run's config as its summary.json records it, with the command line's MAY_CHANGE values on top; refused
    (DprunError) or RunComplete unless there is something to train from an intact checkpoint."""
    from omegaconf import OmegaConf

    from runner.methods import METHODS
    from runner.validate import validate_config

    saved = saved_summary(run_dir)["config"]
    merged = OmegaConf.create(saved)
    for key, value in _changes(run_dir, saved, overrides).items():  # distributed.nproc_per_node=2: a nested key
        OmegaConf.update(merged, key, value, force_add=True)
    cfg = {**OmegaConf.to_container(merged), "resume": str(run_dir),
           "out_dir": str(run_dir) if saved.get("out_dir") else None}  # null: Hydra's run folder, run_dir
    validate_config(OmegaConf.create(cfg))  # e.g. epochs=abc, before it is compared below
    method = str((saved.get("method") or {}).get("name"))
    if method in METHODS and METHODS.get(method).not_resumable:
        raise DprunError(f"resume={run_dir}: {METHODS.get(method).not_resumable}")
    done = int(load(run_dir, mmap=True)["epoch"])  # a damaged file is refused here, before Hydra starts
    published = check_published(run_dir, done)  # what metrics.csv and summary.json say, not the checkpoint
    # behind: publish, then finish; every epoch published but the run stopped before its end: finish it
    if nothing_to_train(run_dir, done, int(cfg["epochs"])) and published == done and finished(run_dir):
        raise RunComplete(f"resume={run_dir}: the run is already complete ({done} epochs, epochs={cfg['epochs']}); "
                          f"nothing to train (epochs=N with N > {done} trains on)")
    return cfg


def _changes(run_dir: Path, saved: dict, overrides: list[str]) -> dict[str, Any]:
    """The command line's values of MAY_CHANGE keys. Any other key may only restate the run's own value
    (`method=reweight` for a reweight run): a resume is the same run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from runner.overrides import CONFIG_GROUPS

    parser, changes = OverridesParser.create(), {}
    may_change = [k for k in MAY_CHANGE if k not in SET_BY_RESUME]
    for arg in overrides:
        try:
            override = parser.parse_override(arg)
        except HydraException as e:
            raise DprunError(f"resume={run_dir}: cannot read {arg!r} (key=value)") from e
        if override.is_sweep_override():
            raise DprunError(f"resume={run_dir}: {arg} is a sweep; a resume continues one run")
        key, value = override.key_or_group, None if override.is_delete() else override.value()
        if key.split(".")[0] in may_change:  # distributed.nproc_per_node: any world size
            changes[key] = value
            continue
        has: Any = saved
        for part in key.split("."):
            has = has.get(part) if isinstance(has, dict) else None
        if key in CONFIG_GROUPS and isinstance(has, dict):  # method=reweight: the group's chosen option
            has = has.get("name")
        if value != has or key in SET_BY_RESUME:
            raise DprunError(f"resume={run_dir}: {arg} would change the run ({key}={has!r} there); a resume "
                             f"continues the run as its summary.json records it, changing only {', '.join(may_change)}")
    return changes
