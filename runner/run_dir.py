"""One run, one folder: a run never writes into a folder that already holds another run's results.

    ensure_fresh("outputs/runs/x")                    # DprunError if x holds summary.json, metrics.csv or checkpoint.pt
    check_reused_dirs(["out_dir=outputs/runs/x"])     # the same, from the command line, before Hydra writes .hydra/
    check_reused_dirs(["-m", "hydra.sweep.dir=s"])    # DprunError if s holds an earlier sweep
    discard_unstarted("outputs/runs/x")               # a refused run's folder (.hydra/ + dprun.log only) goes

Hydra's default run and sweep folders are unique (time + a random id), but `out_dir=`, `hydra.run.dir=` and
`hydra.sweep.dir=` name a folder explicitly, and re-using one would silently replace the earlier run's metrics and
summary, or (a sweep) its jobs' .hydra/ config records, which Hydra rewrites before each job starts.
"""
from __future__ import annotations

from pathlib import Path

from runner.errors import DprunError

# what makes a folder a run; .hydra/ alone does not. checkpoint.pt too (review 42: a run started beside another's
# checkpoint, then resumed, took that run's model and steps as its own)
RESULT_FILES = ("summary.json", "metrics.csv", "checkpoint.pt")
HYDRA_RECORD = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes into <run dir>/.hydra/


def holds_run(folder: str | Path) -> bool:
    return any((Path(folder) / name).exists() for name in RESULT_FILES)


def ensure_fresh(folder: str | Path) -> None:
    if holds_run(folder):
        raise DprunError(f"folder {str(folder)!r} already holds a run (summary.json, metrics.csv or "
                         f"checkpoint.pt); "
                         f"pass a fresh out_dir= (or hydra.run.dir=), or leave both unset for a new folder")
    if (Path(folder) / "multirun.yaml").exists():  # a sweep's folder: its jobs' runs are in its subfolders
        raise DprunError(f"folder {str(folder)!r} holds a sweep (multirun.yaml); pass a fresh out_dir= (or "
                         f"hydra.run.dir=), or leave both unset for a new folder")


def check_not_file(key: str, value: str) -> None:
    """A run or sweep folder named on the command line that is a file, or lies below one: one line, before Hydra
    tries to make it (FileExistsError, NotADirectoryError)."""
    path = Path(value)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == path else f"lies inside {str(existing)!r}, which is a file"
        raise DprunError(f"{key}={value} {where}, not a folder; pass a folder's path (a new one is made)")


def holds_sweep(folder: str | Path) -> bool:
    """An earlier sweep's folder: Hydra's multirun.yaml, or a run anywhere below."""
    folder = Path(folder)
    return (folder / "multirun.yaml").exists() or any(any(folder.rglob(name)) for name in RESULT_FILES)


def check_reused_dirs(argv: list[str]) -> None:
    """ensure_fresh on the literal folders of `out_dir=` and (single runs) `hydra.run.dir=` overrides, and for a
    sweep (-m) a literal `hydra.sweep.dir=` that holds an earlier sweep.

    Checked before Hydra starts because Hydra rewrites <run dir>/.hydra/ (the earlier run's config record)
    before the job runs. Values with interpolations or sweeps are left to the check in runner/train.py."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or key not in ("out_dir", "hydra.run.dir", "hydra.sweep.dir"):
            continue
        if value in ("", "null") or any(c in value for c in "${},()"):
            continue
        value = value.strip("'\"")
        check_not_file(key, value)
        if key == "hydra.sweep.dir":
            if multirun and holds_sweep(value):
                raise DprunError(f"folder {value!r} already holds a sweep (multirun.yaml or runs); pass a fresh "
                                 f"hydra.sweep.dir=, or leave it unset for a new folder")
        elif not (key == "hydra.run.dir" and multirun):
            ensure_fresh(value)


def check_job_folders(argv: list[str]) -> None:
    """One folder per job, before Hydra writes anything: refused in one line
    - under -m, `out_dir=X` that is not swept over one distinct folder per job (every job would write into X: the
      second one found the first one's run there), and `hydra.run.dir=` (Hydra ignores it under -m);
    - `hydra.sweep.subdir=` without ${hydra.job.num} (each job would rewrite the previous job's .hydra/ record);
    - `hydra.output_subdir=` that is not a plain folder name (`../other/.hydra` rewrites another run's record).
    An interpolated out_dir is left to the check each job makes before it writes (runner/cli.py: run)."""
    import re

    from runner.overrides import chosen_options, group_options, parsed_overrides, CONFIG_GROUPS

    multirun = any(a in ("-m", "--multirun") for a in argv)
    parsed = parsed_overrides(argv)
    for arg, o in parsed:
        key, value = o.key_or_group, arg.partition("=")[2].strip("'\"")
        if o.is_delete() or value in ("", "null"):
            continue
        if key == "hydra.sweep.subdir" and (not re.search(r"\$\{\s*hydra\.job\.num\s*\}", value)
                                             or _leaves_folder(value)):
            raise DprunError(f"hydra.sweep.subdir={value} is not valid: it must contain ${{hydra.job.num}} (one "
                             f"folder per job of a sweep) and stay inside hydra.sweep.dir, e.g. "
                             f"'hydra.sweep.subdir=${{hydra.job.num}}_mine'; or leave it unset")
        if key == "hydra.output_subdir" and (not re.fullmatch(r"[^/\\$]+", value) or value in (".", "..")):
            raise DprunError(f"hydra.output_subdir={value} is not valid: it must be a plain folder name inside the "
                             f"run's folder (e.g. .hydra, the default), or null for no record")
        if multirun and key == "hydra.run.dir":
            raise DprunError(f"{arg}: dprun -m does not use hydra.run.dir (each job's folder is hydra.sweep.dir/"
                             f"hydra.sweep.subdir); name the sweep's folder with hydra.sweep.dir={value}")
    if not multirun:
        return
    for arg, o in parsed:
        if o.key_or_group != "out_dir" or o.is_delete():
            continue
        folders = list(o.sweep_string_iterator()) if o.is_sweep_override() and o.is_discrete_sweep() else \
            [arg.partition("=")[2]]
        if any("${" in f for f in folders):  # interpolated: each job checks its own folder before it writes
            continue
        folders = [f.strip("'\"") for f in folders]
        if all(f in ("", "null") for f in folders):
            continue
        jobs = 1
        for _, other in parsed:
            if other is o or not other.is_sweep_override():
                continue
            if other.key_or_group in CONFIG_GROUPS:
                jobs *= len(chosen_options(other, group_options(other.key_or_group)))
            else:
                jobs *= len(list(other.sweep_string_iterator())) if other.is_discrete_sweep() else 2  # interval()
        presets = any(p.key_or_group == "experiment" and str(p.value()) not in ("null", "None") for _, p in parsed)
        if jobs > 1 or presets or len(set(folders)) < len(folders):
            raise DprunError(f"{arg} under -m would put several jobs of the sweep into one folder (each job after "
                             f"the first would find a run there); leave out_dir unset and name the sweep's folder "
                             f"with hydra.sweep.dir={folders[0]} (one subfolder per job)")


def _leaves_folder(value: str) -> bool:
    return value.startswith(("/", "\\")) or ".." in value.replace("\\", "/").split("/")


def discard_unstarted(folder: str | Path) -> bool:
    """Remove a run folder that holds nothing but Hydra's .hydra/ record and dprun.log: what a run refused before
    training leaves. Anything else in it (results, a checkpoint, a user's file, a link) keeps the whole folder, and
    only those known files are ever deleted. -> whether the folder was removed."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return False
    hydra = folder / ".hydra"
    known = {folder / "dprun.log", *(hydra / name for name in HYDRA_RECORD)}
    files = [p for p in folder.rglob("*") if p != hydra]  # rglob does not descend into linked folders
    if hydra.is_symlink() or (hydra.exists() and not hydra.is_dir()):
        return False
    if any(p not in known or p.is_symlink() or not p.is_file() for p in files):
        return False
    for path in files:
        path.unlink()
    if hydra.exists():
        hydra.rmdir()
    folder.rmdir()
    return True


def new_parents(run_dir: str) -> set[Path]:
    """The folders above a run folder (hydra.run.dir's value, `${now:...}` filled in as Hydra will) that do not exist
    yet: Hydra makes them with the run's folder, and a refused run removes them again (remove_empty_parents). A
    part that is another interpolation ends the known prefix."""
    import re
    from datetime import datetime

    folder, missing = Path.cwd(), set()
    for part in Path(run_dir).parts[:-1]:
        part = re.sub(r"\$\{now:([^}]*)\}", lambda m: datetime.now().strftime(m.group(1)), part)
        if "${" in part:
            break
        folder = folder / part
        if not folder.exists():
            missing.add(folder.absolute())
    return missing


def remove_empty_parents(folder: str | Path, made: set[Path]) -> None:
    """After a refused run's folder is gone: its parents that this command made (`made`, from new_parents) and that
    are empty now, deepest first (outputs/runs/<date>/ of a first run refused that day)."""
    parent = Path(folder).absolute().parent
    while parent in made and parent.is_dir() and not parent.is_symlink() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def discard_hydra_record(folder: str | Path) -> None:
    """Remove the .hydra/ record Hydra wrote into a folder that existed before the run (a user's out_dir= folder,
    refused before training): the folder and anything else in it stay."""
    hydra = Path(folder) / ".hydra"
    if hydra.is_dir() and not hydra.is_symlink():
        for name in HYDRA_RECORD:
            (hydra / name).unlink(missing_ok=True)
        if not any(hydra.iterdir()):
            hydra.rmdir()


def hydra_config(folder: Path) -> dict:
    """The job config Hydra recorded in folder/.hydra/config.yaml, resolved where the resolvers allow."""
    from omegaconf import OmegaConf

    from runner.paths import register_resolvers

    register_resolvers()
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    try:
        out = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001  e.g. a resolver of another version: the unresolved record is still useful
        out = OmegaConf.to_container(cfg, resolve=False)
    return out if isinstance(out, dict) else {}


def out_dir_of(folder: Path, cfg: dict) -> Path | None:
    """Where a run that named out_dir= put its files (Hydra's own folder keeps only .hydra/): relative to the
    directory dprun ran in, which Hydra records as hydra.runtime.cwd. None without out_dir."""
    out_dir = cfg.get("out_dir")
    if not out_dir:
        return None
    target = Path(str(out_dir))
    if not target.is_absolute():
        from omegaconf import OmegaConf

        cwd = OmegaConf.select(OmegaConf.load(folder / ".hydra" / "hydra.yaml"), "hydra.runtime.cwd", default=None)
        target = Path(cwd or ".") / target
    return target


def _results_went_elsewhere(folder: Path, cfg: dict) -> bool:
    target = out_dir_of(folder, cfg)
    return target is not None and holds_run(target)


def unstarted_runs(root: str | Path) -> list[tuple[Path, dict]]:
    """(folder, its Hydra config) of every folder under root holding .hydra/ but no results: a run that stopped
    before its first summary.json (bad input, missing data, out of memory building the model), or one still
    loading its data. Without this such failures are invisible in dprun-report."""
    found = []
    for hydra_dir in sorted(Path(root).rglob(".hydra")):
        folder = hydra_dir.parent
        if not hydra_dir.is_dir() or holds_run(folder):
            continue
        try:
            cfg = hydra_config(folder)
            if _results_went_elsewhere(folder, cfg):
                continue
        except Exception:  # noqa: BLE001  a damaged record still marks a run that did not start
            cfg = {}
        found.append((folder, cfg))
    return found


def run_dir_in_out_dir(argv: list[str]) -> list[str]:
    """A single run's literal `out_dir=X` is Hydra's run folder too (hydra.run.dir=X): its .hydra/ record goes into
    X, and nothing is written outside it (no outputs/runs/<date>/... holding only .hydra/). A sweep, an explicit
    hydra.run.dir= or an interpolated out_dir are left as they are."""
    if {"-m", "--multirun"} & set(argv) or any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        return argv
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if key == "out_dir" and sep and value not in ("", "null") and not any(c in value for c in "${},()"):
            return [*argv, f"hydra.run.dir={value}"]
    return argv
