# dprun — `make help` lists the targets. Everything runs from a fresh clone after `make install`.
# PY: the python of the virtual environment VENV (.venv, made by `make install`) if it exists, else the one on PATH
# (checked when each command runs, so `make install demo` uses the venv it just made).
VENV ?= .venv
PY ?= $$(test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo python)
# torch for a venv without one: the CPU build from PyTorch's CPU index, unless nvidia-smi finds a GPU (then PyPI's
# CUDA build). A torch already in the venv is kept. TORCH_INDEX= (empty) uses pip's configured index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
SCALE ?= smoke

.PHONY: help install torch demo test test-slow bench

help: ## list the targets (coloured on a terminal only)
	@if [ -t 1 ]; then c='\033[36m'; n='\033[0m'; else c=''; n=''; fi; \
	grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | awk -v c="$$c" -v n="$$n" 'BEGIN {FS = ":.*## "}; {printf "  %s%-18s%s %s\n", c, $$1, n, $$2}'

install: torch ## make .venv, add torch (CPU build unless a GPU; an installed torch is kept), dprun[test] (editable)
	$(VENV)/bin/python -m pip install -q -e ".[test]"

torch: ## make the venv if missing and install torch into it if it has none (CPU build on a machine without a GPU)
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	@if $(VENV)/bin/python -c "import torch" 2>/dev/null; then echo "keeping torch $$($(VENV)/bin/python -c 'import torch; print(torch.__version__)')"; \
	elif nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || [ -z "$(TORCH_INDEX)" ]; then $(VENV)/bin/python -m pip install -q torch; \
	else $(VENV)/bin/python -m pip install -q torch --index-url $(TORCH_INDEX); fi

demo: ## the built-in demo: non-private MLP on scikit-learn's digits, CPU, seconds
	$(PY) -m runner.cli

test: ## the default test suite (fast; slow sweeps are excluded)
	$(PY) -m pytest -q

test-slow: ## the slow suite: end-to-end figure sweeps at smoke scale
	$(PY) -m pytest -q -m slow

# --- benchmarks (ratios measured side by side in one process) ---
BENCH_ARGS ?=
.PHONY: bench-clip
bench-clip: ## exact clipping methods vs non-private and Opacus, side by side (BENCH_ARGS="--device cuda --quick")
	$(PY) -m runner.bench.clip $(BENCH_ARGS)

.PHONY: bench-jl
bench-jl: ## DP-SGD-JL step time vs r (forward-mode vs double-vjp) vs non-private and ReweightGP (BENCH_ARGS="--quick")
	$(PY) -m runner.bench.jl $(BENCH_ARGS)

.PHONY: bench-gpu
bench-gpu: ## issue 12's GPU table: bench-clip (+ Opacus, + compile=reduce-overhead rows) and bench-jl on CUDA -> outputs/bench/{clip,jl}_cuda.csv
	$(PY) -m runner.bench.clip --device cuda --suite gpu --compile reduce-overhead $(BENCH_ARGS)
	$(PY) -m runner.bench.jl --device cuda --suite gpu --memory --r 1,4 $(BENCH_ARGS)

# --- figures and tables ---
# make figures SCALE=smoke (default; CPU minutes) | SCALE=paper (the papers' hyperparameters, for a GPU).
# Each fig-<name>: the preset's Hydra sweeps (runner/figures/sweep.py), dprun-report, then the plot (docs/figures.md).
# SWEEP_ARGS go to every dprun of a sweep, e.g. SWEEP_ARGS="launcher=slurm" or "device=cuda data_dir=/data".
FIGURES_TRAINED := jl_fig3 jl_table2 jl_fig1 jl_fig4 jl_table3 jl_fig5 jl_fig6 lk_fig5 lk_fig6 lk_fig7 jl_table5 lk_fig8 lk_fig9 lk_memory
FIGURES_COMPUTED := jl_table1 jl_fig2 jl_fig7 jl_table4 jl_epsilon_r sbcd_hsa_vs_composition sbcd_epoch_contribution sbcd_adaptive_noise
TABLES := jl_table1 jl_table2 jl_table3 jl_table4 jl_table5
SWEEP_ARGS ?=
REPORT = $(PY) -m runner.report --quiet && $(PY) -m runner.report --epochs --quiet
.PHONY: figures tables report plots figures-list memory-study

figures: ## every table and figure of the three works -> outputs/figures/*.png|pdf, outputs/tables/*.csv
	$(PY) -m runner.figures.sweep $(FIGURES_TRAINED) --scale $(SCALE) -- $(SWEEP_ARGS)
	$(REPORT)
	$(PY) -m runner.plots $(FIGURES_TRAINED) $(FIGURES_COMPUTED) --scale $(SCALE)

tables: ## the papers' tables only (JL Tables 1-3) as PNG + CSV
	$(PY) -m runner.figures.sweep $(TABLES) --scale $(SCALE) -- $(SWEEP_ARGS)
	$(REPORT)
	$(PY) -m runner.plots $(TABLES) --scale $(SCALE)

fig-%: ## one table or figure, e.g. make fig-jl_table2 SCALE=smoke (list: make figures-list)
	$(PY) -m runner.figures.sweep $* --scale $(SCALE) -- $(SWEEP_ARGS)
	$(REPORT)
	$(PY) -m runner.plots $* --scale $(SCALE)

memory-study: ## L&K 6.7: largest batch per method by bisection, one process per probe (SWEEP_ARGS="memory_study.memory_cap_bytes=11e9")
	$(PY) -m runner.memory_study --scale $(SCALE) -- $(SWEEP_ARGS)
	$(REPORT)
	$(PY) -m runner.plots lk_memory --scale $(SCALE)

# --- paper-scale reference runs (outputs/reference/paper/; issue 13) ---
DATA_DIR ?= $(DPRUN_DATA_DIR)
PAPER_ARGS ?=
RUNS_DIR ?= outputs/reference/paper/runs
.PHONY: paper-runs paper-readme
paper-runs: ## MNIST + IMDB at the JL paper's settings, full epochs, then the README (DATA_DIR=... PAPER_ARGS="--only mnist --device cuda")
	$(PY) -m runner.paper_runs run --data-dir $(DATA_DIR) --out $(RUNS_DIR) $(PAPER_ARGS)
	$(PY) -m runner.paper_runs readme --runs $(RUNS_DIR)

paper-readme: ## outputs/reference/paper/README.md from a folder of runs, copied in first (RUNS_DIR=/work/paper_runs)
	$(PY) -m runner.paper_runs readme --runs $(RUNS_DIR) --import-to outputs/reference/paper/runs

report: ## dprun-report over outputs/: one row per run (outputs/tables/runs.csv)
	$(PY) -m runner.report

plots: ## redraw every figure from the existing tables (no training)
	$(REPORT)
	$(PY) -m runner.plots $(FIGURES_TRAINED) $(FIGURES_COMPUTED) --scale $(SCALE)

figures-list: ## the figure names, the preset each reads, and its estimated GPU time at scale=paper
	$(PY) -m runner.plots --list
