"""`dprun`: compose conf/ with Hydra, run one training job, print where its outputs went.

    dprun                                        # the demo: digits, MLP, non-private, CPU
    dprun method=jl r=4 dataset=cifar10          # DP-SGD-JL on CIFAR-10 with the JL paper's CNN
    dprun -m model=cnn,mlp dataset=digits        # a Hydra multirun sweep
    dprun method=foo                             # dprun: unknown method 'foo'; valid: ...
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.epsilon_shown import shown_epsilon, shown_value
from runner import run_lock
from runner.errors import DprunError, RunComplete
from runner.interrupt import interrupted_exit, sigterm_as_interrupt
from runner.overrides import (CONFIG_GROUPS, check_group_choices, check_group_keys, check_noise, check_scale,
                              check_sweeps)
from runner.paths import CONF_DIR, register_resolvers
from runner.registry import unknown_name_message
from runner.run_dir import (check_job_folders, check_reused_dirs, discard_hydra_record, discard_unstarted,
                            ensure_fresh, new_parents, remove_empty_parents, run_dir_in_out_dir)
from runner.speaker import Speaker

register_resolvers()  # before @hydra.main composes conf/
NEW_DIRS: set[Path] = set()  # out_dir= folders that did not exist before Hydra made them (main() notes them)
NEW_PARENTS: set[Path] = set()  # the folders above a single run's folder that Hydra will make (outputs/runs/<date>)
EXIT_DIVERGED = 3  # a run whose loss or parameters became non-finite (status `diverged`); 2: refused; 1: failed
SWEEP_FAILED: list[str] = []  # this process's sweep jobs refused or diverged (_hydra_main), for SweepStatus


def run(cfg: DictConfig, speaker: Speaker | None = None) -> dict:
    from runner.train import train

    out_dir = output_dir(cfg)
    if not (speaker or Speaker.here()).main:  # another rank of a distributed run: rank 0 writes and prints
        with sigterm_as_interrupt():
            return train(cfg, out_dir)
    with run_lock.holding(out_dir):  # before the log: a second writer (resume= of a running run) touches nothing
        if not cfg.get("resume"):  # before the log too: a run refused another run's folder writes nothing into it
            ensure_fresh(out_dir)
        log_file = logging.FileHandler(Path(out_dir) / "dprun.log")  # the run's log (Slurm jobs have no terminal)
        log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(log_file)
        try:
            with sigterm_as_interrupt():  # SIGTERM (timeout, Slurm) ends the run like Ctrl-C: status `interrupted`
                summary = train(cfg, out_dir)
        except (Exception, KeyboardInterrupt) as e:  # the log says why the run ended (on Slurm it is all one has);
            # written to the file only: the terminal gets the one line main() prints
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed: {type(e).__name__}: {e}"
            log_file.emit(logging.makeLogRecord({"msg": f"run {why}", "levelname": "ERROR",
                                                 "levelno": logging.ERROR}))
            raise
        finally:
            logging.getLogger().removeHandler(log_file)
            log_file.close()
    print_result(summary, out_dir, table=_interactive())
    return summary


def output_dir(cfg: DictConfig) -> str:
    return cfg.out_dir or HydraConfig.get().runtime.output_dir


def _interactive() -> bool:
    """A single run on a terminal: a progress bar while it trains, then the per-epoch table (and no per-epoch log
    lines on the terminal, so the epochs are printed once). Otherwise (a sweep, a log file): one line per epoch as
    it finishes, with the ETA, and no table at the end. dprun.log has the lines either way."""
    try:
        single = HydraConfig.get().mode != RunMode.MULTIRUN
    except ValueError:  # not under Hydra (run() called directly)
        single = True
    return single and sys.stderr.isatty()


class _NoEpochLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "epoch_line", False)


def print_result(summary: dict, out_dir, table: bool = True) -> None:
    import pandas as pd

    if not table:
        final = summary.get("final") or {}
        eps = final.get("epsilon")
        eps_text = f", epsilon {shown_epsilon(float(eps))}" if eps not in (None, "") else ""
        acc_text = f": test_acc {final['test_acc']:.4f}" if "test_acc" in final else ""
        print(f"dprun: {summary['method']} on {summary['config']['dataset']['name']}{acc_text}{eps_text} -> {out_dir}")
        print_guarantee(summary)
        return
    table = pd.read_csv(Path(out_dir) / "metrics.csv")
    cols = [c for c in ("epoch", "train_loss", "test_acc", "epoch_time_s", "step_time_s") if c in table]
    cols += [c for c in table.columns if c.startswith("epsilon") and table[c].notna().any()]  # + hsa's baseline
    for c in cols:  # epsilons rounded up, a lower bound down (shown_value): never shown past the certified value
        if c.startswith("epsilon"):
            table[c] = table[c].map(lambda v, c=c: "" if pd.isna(v) else shown_value(c, float(v)))
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"dprun: {summary['method']} on {summary['config']['dataset']['name']} -> {out_dir}")
    print_guarantee(summary)


def print_guarantee(summary: dict) -> None:
    """A private run's last lines: why its epsilon is inf where it is (summary's epsilon_note), and whether its
    guarantee assumes a secret seed (runner/randomness.py)."""
    from runner.randomness import end_line  # (torch: imported when a run has ended, not for --help)

    if summary.get("epsilon_note"):
        print(f"dprun: {summary['epsilon_note']}")
    note = end_line(summary)
    if note:
        print(f"dprun: {note}")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    speaker = Speaker.here()  # runner/speaker.py: what this rank prints and writes
    speaker.configure_logging()
    logging.getLogger("dprun").disabled = False  # hydra/job_logging=disabled disables existing loggers per job
    if _interactive():
        for handler in logging.getLogger().handlers:
            handler.addFilter(_NoEpochLines())
    out_dir = Path(output_dir(cfg))
    new_out_dir = not out_dir.exists() or out_dir.resolve() in NEW_DIRS  # a refused run removes only what it made
    try:
        run(cfg, speaker)
    except DprunError as e:
        from runner.train import Diverged

        speaker.last_line("failed" if isinstance(e, Diverged) else "refused", str(e))
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # a sweep goes on with its other jobs: this one line, no
            SWEEP_FAILED.append(str(e))  # traceback (Hydra prints one for a job that raises); SweepStatus exits 1
            return
        if speaker.main and not isinstance(e, (Diverged, run_lock.InUse)):  # in use: the folder is another's
            discard_refused(cfg, out_dir if new_out_dir else None)
        sys.exit(EXIT_DIVERGED if isinstance(e, Diverged) else 2)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the complete epochs are on disk; one line, no traceback
        line, code = interrupted_exit(e, output_dir(cfg))
        speaker.last_line("interrupted", line.removeprefix("dprun: "))
        sys.exit(code)
    except Exception as e:  # noqa: BLE001  a distributed rank's error: one line naming the rank (the launcher's
        # own report follows); a single process keeps Hydra's traceback
        if speaker.size == 1:
            raise
        from runner.distributed import broken_collective

        if broken_collective(e):
            speaker.last_line("stopped", "stopped: another rank stopped (its line says why)")
        else:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            speaker.last_line("failed", f"failed: {type(e).__name__}: {first}")
        sys.exit(1)


class SweepStatus(Callback):
    """A sweep's exit status (conf/config.yaml: hydra.callbacks). A job refused or diverged prints its one line and
    returns (_hydra_main), so Hydra goes on without a traceback; at the sweep's end the command exits 1 if a job of
    this process was (SWEEP_FAILED) or dprun-report finds a job folder that did not finish (a launcher's worker
    process or node: failed-to-start, diverged). A job that raised anything else ends the sweep as Hydra does."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from runner.report import collect

        failed = bool(SWEEP_FAILED)
        SWEEP_FAILED.clear()  # (a test's in-process sweeps share this module)
        runs = collect(Path(str(config.hydra.sweep.dir)), reference=True)
        if failed or (not runs.empty and (runs["status"] != "finished").any()):
            sys.exit(1)


def discard_refused(cfg: DictConfig, out_dir: Path | None) -> None:
    """A single run refused before training (bad input, missing data: a DprunError before summary.json) leaves no
    folder: Hydra's run folder and a new out_dir go if they hold only .hydra/ and dprun.log (run_dir.discard_unstarted);
    the one line on the terminal is the record. Kept: a resumed run's folder (the earlier run's) and, in a sweep, the
    refused job's folder: dprun-report lists it as failed-to-start with the reason from its dprun.log, so a missing
    cell of the grid stays visible (docs/figures.md)."""
    if cfg.get("resume"):
        return
    hydra_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.out_dir and out_dir is None and hydra_dir.resolve() == Path(cfg.out_dir).resolve():  # a user's folder
        discard_hydra_record(hydra_dir)  # it stays, without the record Hydra wrote into it
    elif discard_unstarted(hydra_dir):
        remove_empty_parents(hydra_dir, NEW_PARENTS)  # e.g. outputs/runs/<date>/, if this run made it
    if out_dir is not None and discard_unstarted(out_dir):
        remove_empty_parents(out_dir, NEW_PARENTS)


def extra_sweeps_note(argv: list[str]) -> str | None:
    """One line when `dprun -m experiment=X` runs only X's grid while X also lists `extra_sweeps` (arms outside the
    grid, e.g. JL's r), which `make fig-X` runs as well; None otherwise (and inside runner.figures.sweep)."""
    import os

    if not {"-m", "--multirun"} & set(argv) or os.environ.get("DPRUN_FIGURE_SWEEP"):
        return None
    exp = next((a.partition("=")[2] for a in argv if a.startswith("experiment=")), None)
    path = Path(CONF_DIR) / "experiment" / f"{exp}.yaml"
    if not exp or not path.exists() or "extra_sweeps" not in OmegaConf.load(path):
        return None
    scale = next((a.partition("=")[2] for a in argv if a.startswith("scale=")), "smoke")
    return (f"dprun: note: this runs experiment={exp}'s grid only; its extra_sweeps (arms outside the grid) run with "
            f"`make fig-{exp} SCALE={scale}` (python -m runner.figures.sweep {exp} --scale {scale})")
def shared_seed_note(argv: list[str]) -> str | None:
    """One line when `dprun -m ...` runs several jobs with one seed under rng=seeded: they draw the same noise, so
    two of them published together cancel it (docs/privacy.md, "One run"); None for one run, a seed sweep,
    rng=secure, and the figure sweeps (their runs are figures, not models to publish)."""
    import os

    from runner.overrides import parsed_overrides

    if not {"-m", "--multirun"} & set(argv) or os.environ.get("DPRUN_FIGURE_SWEEP"):
        return None
    parsed = {o.key_or_group: o for _, o in parsed_overrides(argv)}
    if "seed" in parsed and parsed["seed"].is_sweep_override() or "rng=secure" in argv:
        return None
    if not any(o.is_sweep_override() for o in parsed.values()) and "experiment" not in parsed:
        return None  # -m over one job
    return ("dprun: note: these jobs share one seed under rng=seeded, so they draw the same noise: two of them "
            "published together (e.g. models of an lr sweep) cancel it; publish at most one, or sweep seed too, or "
            "use rng=secure")


LAUNCHER_PLUGINS = {"joblib": "hydra_plugins.hydra_joblib_launcher", "submitit_local": "hydra_plugins.hydra_submitit_launcher",
                    "slurm": "hydra_plugins.hydra_submitit_launcher"}  # the `launchers` extra


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package (hydra_plugins) is absent
        return False


def check_launcher_extra(argv: list[str]) -> None:
    """launcher=joblib|submitit_local|slurm without the `launchers` extra: one line naming it."""
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        for choice in value.split(",") if key == "launcher" else []:
            if choice in LAUNCHER_PLUGINS and not _importable(LAUNCHER_PLUGINS[choice]):
                raise DprunError(f"launcher={choice} needs its Hydra plugin: pip install 'dprun[launchers]' "
                                 "(or -e '.[launchers]' in a checkout)")


def known_keys() -> list[str]:
    """Top-level config keys: config.yaml's, those that global presets and dataset/method files set, the groups."""
    import yaml

    keys = set(CONFIG_GROUPS) | {"hydra", "experiment_tag"}
    for path in Path(CONF_DIR).rglob("*.yaml"):
        text = path.read_text()
        if path.name == "config.yaml" or "@package _global_" in text:
            keys |= set((yaml.safe_load(text) or {}).keys()) - {"defaults"}
    return sorted(keys)


def check_keys(argv: list[str]) -> None:
    """`batchsize=32` or `+batchsize=32` (a new key nothing reads) is refused with one line, not run and ignored."""
    import re

    valid = None
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        first = re.split(r"[./@]", arg.lstrip("+~").split("=", 1)[0])[0]
        valid = valid or known_keys()
        if first not in valid:
            raise DprunError(unknown_name_message("key", first, valid) + " (dprun --help lists them)")


def main() -> None:
    if "--version" in sys.argv[1:]:  # dprun's version, not Hydra's (Hydra would answer --version itself)
        from runner import __version__

        print(f"dprun {__version__}")
        return
    from runner import launch

    argv = sys.argv[1:]
    try:  # every check before any process starts or any file is written: refused in one line
        check_group_choices(argv)
        check_launcher_extra(argv)
        check_keys(argv)
        resuming = any(a.lstrip("+").startswith("resume=") and a.partition("=")[2] not in ("", "null") for a in argv)
        if not resuming:  # (a resume's keys are checked against that run's own config: resume_argv)
            check_group_keys(argv)  # method.r=3 under method=nonprivate: one line, not Hydra's "not in struct"
        check_scale(argv)  # scale=huge: before Hydra resolves ${scales.huge.*}
        check_noise(argv)  # sigma= with target_epsilon=
        check_job_folders(argv)  # one folder per job: out_dir= under -m, hydra.sweep.subdir=, hydra.output_subdir=
        check_reused_dirs(argv)
        # resume=<dir>: that run's own config (summary.json), continued in its folder; checked before Hydra writes
        if resuming:
            from runner.checkpoint import resume_argv  # (dp-accounting, scipy: only to resume)

            argv_run = resume_argv(argv)
        else:
            argv_run = argv
        check_sweeps(argv_run)  # r=1,4 without -m (a resume's own check names its sweeps first)
        for note in (extra_sweeps_note(argv), shared_seed_note(argv)):  # after the checks: a refused command says
            if note:  # one line only
                print(note, file=sys.stderr)
        hydra_argv = run_dir_in_out_dir(argv_run)  # out_dir=X: Hydra's .hydra/ record inside X too
        NEW_DIRS.update(Path(a.partition("=")[2]).resolve() for a in hydra_argv
                        if a.startswith("hydra.run.dir=") and not Path(a.partition("=")[2]).exists())
        NEW_PARENTS.clear()  # (a test's in-process runs share this module)
        if not resuming and not {"-m", "--multirun"} & set(hydra_argv):
            NEW_PARENTS.update(new_parents(run_dir_pattern(hydra_argv)))
        nproc = launch.processes(argv)  # distributed.nproc_per_node=N, or what a resumed run recorded
        if nproc > 1 and Speaker.here().size == 1:  # start the N ranks, each running this command
            sys.exit(launch.launch(argv, nproc, new_dirs=set(NEW_DIRS)))
        sys.argv[1:] = rank_argv(hydra_argv)
    except RunComplete as e:  # nothing to train: not an error
        print(f"dprun: {e}")
        sys.exit(0)
    except DprunError as e:
        print(f"dprun: {e}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()


def run_dir_pattern(argv: list[str]) -> str:
    """hydra.run.dir as the command line gives it, else conf/config.yaml's (outputs/runs/${now:%Y-%m-%d}/...)."""
    given = [a.partition("=")[2] for a in argv if a.lstrip("+").startswith("hydra.run.dir=")]
    if given:
        return given[-1]
    import yaml

    return str(yaml.safe_load((Path(CONF_DIR) / "config.yaml").read_text())["hydra"]["run"]["dir"])


def rank_argv(argv: list[str]) -> list[str]:
    """Under torchrun/srun, ranks other than 0 write nothing: Hydra's run folder (which every rank would otherwise
    create, each with its own time stamp) goes to a temporary folder without a .hydra record."""
    speaker = Speaker.here()
    if speaker.size > 1 and {"-m", "--multirun"} & set(argv):
        raise DprunError("dprun -m under torchrun/srun would run the sweep on every rank, each in its own folder; "
                         "sweep distributed runs with a launcher's tasks (launcher=slurm hydra.launcher.tasks_per_node"
                         "=N) or start one torchrun per run")
    if speaker.main:
        return argv
    import atexit
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix=f"dprun-rank{speaker.rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return [a for a in argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={scratch}",
                                                                       "hydra.output_subdir=null"]


if __name__ == "__main__":
    main()
