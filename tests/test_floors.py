"""The import floors: a module imports only from its own floor or the floors below it, and no two parts import
each other (in a cycle). Every import counts, also one inside a function. A new module must be placed on a floor
here, so that where it may import from is decided once. The floors follow the data flow of one run (README.md, Layout):
pieces, then the method that combines them, the run that drives the method, the entry points that start runs, and
what reads and draws finished runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FLOORS = [
    # 0: the package, the one error type, the registry every family uses, and how an epsilon is printed (rounded up)
    ["runner", "runner.errors", "runner.registry", "runner.epsilon_shown"],
    # 1: the pieces of a step, independent of each other: data, models, norm rules, accountants (and the mechanisms
    #    methods describe their steps with), optimizers, timers and writers, progress lines, signal handling, the
    #    precision policy and float32 math flags, the ranks of a distributed run, test-set evaluation, the C heap's settings, a model's
    #    trainable parameters, its activations' memory format, the thread a CUDA backward runs in, a collated batch's
    #    tensors and size
    ["runner.data", "runner.models", "runner.norms", "runner.accountants", "runner.optimizers", "runner.metrics",
     "runner.progress", "runner.interrupt", "runner.precision", "runner.fp32_mode", "runner.distributed",
     "runner.evaluation", "runner.randomness", "runner.heap", "runner.launcher_env", "runner.data_dir", "runner.trainable",
     "runner.memory_format", "runner.backward_thread", "runner.collated"],
    # 2: the clipping methods (Method.attach / Method.step: norms, clipping, noise, the optimizer step)
    ["runner.methods"],
    # 3: one run's surroundings: where conf/ is and its resolvers, knob checks, run folders, overrides, checkpoints,
    #    starting a run's ranks (dprun distributed.nproc_per_node=N) and what each rank says, the one assembly of a
    #    private run (the CLI's and the API's), entry points' one-line errors, the one-run privacy audit (its canaries
    #    meet a Method through one hook, by duck typing), the one-writer lock on a run folder
    ["runner.paths", "runner.validate", "runner.run_dir", "runner.run_lock", "runner.overrides", "runner.checkpoint", "runner.launch",
     "runner.speaker", "runner.assembly", "runner.entry", "runner.audit"],
    # 4: what drives a Method: the training loop and the library API
    ["runner.train", "runner.api"],
    # 5: measurements and tables built on them: the benches, DP-SBCD's privacy curves, the report of finished runs
    ["runner.bench", "runner.sbcd_curves", "runner.report"],
    # 6: the papers' tables and figures (specs, their data, their preset sweeps)
    ["runner.figures"],
    # 7: entry points, which nothing imports: the CLIs, the library's name, the studies, the figure drawing
    ["dprun", "runner.cli", "runner.epsilon_cli", "runner.signal_check", "runner.memory_study", "runner.plots",
     "runner.paper_runs"],
]


def modules() -> dict[str, Path]:
    out = {}
    for package in ("runner", "dprun"):
        for f in (ROOT / package).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def part_of(module: str) -> str | None:
    """The floor entry a module belongs to: itself, or the longest listed package holding it (`runner` and `dprun`
    stand for their __init__.py only)."""
    names = [n for floor in FLOORS for n in floor if module == n or ("." in n and module.startswith(n + "."))]
    return max(names, key=len) if names else None


def floor_of(part: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if part in floor)


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports (`from runner.x import y`: runner.x.y if that is a module, else runner.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (modules on no floor left to test_every_module_is_on_a_floor)"""
    mods = {m: f for m, f in modules().items() if part_of(m)}
    return {m: imports(f, set(mods)) - {m} for m, f in mods.items()}


def test_every_module_is_on_a_floor():
    assert not [m for m in modules() if part_of(m) is None], "place the new module on a floor in FLOORS"


def test_no_module_imports_from_a_higher_floor():
    upward = [f"{m} (floor {floor_of(part_of(m))}) imports {t} (floor {floor_of(part_of(t))})"
              for m, targets in edges().items() for t in targets
              if floor_of(part_of(t)) > floor_of(part_of(m))]
    assert not upward, "\n".join(upward)


def test_no_two_parts_import_each_other():
    graph: dict[str, set[str]] = {}
    for m, targets in edges().items():
        graph.setdefault(part_of(m), set()).update(part_of(t) for t in targets if part_of(t) != part_of(m))
    done, stack = set(), []

    def visit(part):
        if part in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(part):] + [part]))
        if part in done:
            return
        stack.append(part)
        for nxt in sorted(graph.get(part, ())):
            visit(nxt)
        stack.pop()
        done.add(part)

    for part in sorted(graph):
        visit(part)


def test_the_check_sees_an_upward_import(tmp_path):
    """Not vacuous: runner/figures/sweep.py once imported the CLI (for CONF_DIR, now in runner/paths.py), even inside
    a function that import counts."""
    fake = tmp_path / "sweep.py"
    fake.write_text("def conf_dir():\n    from runner.cli import CONF_DIR\n    return CONF_DIR\n")
    assert imports(fake, set(modules())) == {"runner.cli"}
    assert floor_of(part_of("runner.cli")) > floor_of(part_of("runner.figures.sweep"))
