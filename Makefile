# dprun — `make help` lists the targets. Everything runs from a fresh clone after `make install`.
# PY: the python of the virtual environment VENV (.venv, made by `make install`) if it exists, else the one on PATH
# (checked when each target's commands run, so `make install demo` uses the venv it just made; echoed resolved).
VENV ?= .venv
PY ?= $(shell test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo python)
# torch for a venv without one (a torch already in the venv is kept; README "Set up" says the same):
#  - nvidia-smi lists a GPU: `pip install torch`, PyPI's CUDA build;
#  - else the CPU build from TORCH_INDEX (PyTorch's CPU wheel index), if one 5-second look reaches it;
#  - else (TORCH_INDEX= empty, or unreachable) pip's own configured index (a mirror, local wheels), but only a CPU
#    build: pip's dry run of `pip install torch` if that is one, else the newest `+cpu` version the index lists
#    (`pip index versions torch`); PyPI's Linux torch is the CUDA build (nvidia-* packages, several GB), which a
#    machine without a GPU cannot use, so with no CPU build there it stops with one line giving the command for one.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
CPU_INDEX := https://download.pytorch.org/whl/cpu
# stdin: `pip install --dry-run --report -`; prints "cpu|cuda <torch version>" (cuda: it would bring nvidia-* packages)
define TORCH_BUILD
import json, sys
install = json.load(sys.stdin)["install"]
names = [p["metadata"]["name"].lower() for p in install]
version = next((p["metadata"]["version"] for p in install if p["metadata"]["name"].lower() == "torch"), "none")
print("cuda" if any(n.startswith("nvidia-") for n in names) or "+cu" in version else "cpu", version)
endef
export TORCH_BUILD
# stdin: `pip index versions torch` ("Available versions: 2.15.0, ..., 2.13.0+cpu, ...", newest first); prints the
# newest CPU build's version, or nothing
define TORCH_CPU_VERSION
import sys
listed = [v.strip() for line in sys.stdin if line.startswith("Available versions:") for v in line.split(":", 1)[1].split(",")]
print(next((v for v in listed if v.endswith("+cpu")), ""))
endef
export TORCH_CPU_VERSION
SCALE ?= smoke

.PHONY: help install torch demo test lint test-slow bench

help: ## list the targets (coloured on a terminal only)
	@if [ -t 1 ]; then c='\033[36m'; n='\033[0m'; else c=''; n=''; fi; \
	grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | awk -v c="$$c" -v n="$$n" 'BEGIN {FS = ":.*## "}; {printf "  %s%-18s%s %s\n", c, $$1, n, $$2}'

install: torch ## make .venv, add torch (CPU build unless a GPU; an installed torch is kept), dprun[test] (editable; with Opacus and the launchers the tests exercise)
	$(VENV)/bin/python -m pip install -q -e ".[test]"

torch: ## make the venv if missing and install torch into it if it has none (CPU build on a machine without a GPU)
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	@py=$(VENV)/bin/python; \
	if $$py -c "import torch" 2>/dev/null; then echo "keeping torch $$($$py -c 'import torch; print(torch.__version__)')"; \
	elif nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then \
	  echo "torch: nvidia-smi lists a GPU: installing PyPI's CUDA build (pip install torch, several GB)"; \
	  $$py -m pip install -q torch; \
	elif [ -n "$(TORCH_INDEX)" ] && $$py -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=5)" "$(TORCH_INDEX)" 2>/dev/null; then \
	  $$py -m pip install -q torch --index-url "$(TORCH_INDEX)"; \
	else \
	  if [ -n "$(TORCH_INDEX)" ]; then echo "torch: $(TORCH_INDEX) is unreachable from here (one try, 5 s); looking at pip's configured index instead"; fi; \
	  $$py -m pip install -q "pip>=22.2"; \
	  set -- $$($$py -m pip install torch --dry-run --quiet --report - 2>/dev/null | $$py -c "$$TORCH_BUILD" 2>/dev/null); \
	  if [ "$$1" = cpu ]; then echo "torch: installing torch $$2, a CPU build, from pip's configured index"; $$py -m pip install -q torch; \
	  elif [ "$$1" = cuda ] && cpu=$$($$py -m pip index versions torch 2>/dev/null | $$py -c "$$TORCH_CPU_VERSION") && [ -n "$$cpu" ]; then \
	    echo "torch: pip's configured index offers torch $$2, the CUDA build, by default, and also torch $$cpu, a CPU build: installing that"; $$py -m pip install -q "torch==$$cpu"; \
	  elif [ "$$1" = cuda ]; then echo "torch: pip's configured index offers torch $$2, the CUDA build (nvidia-* packages, several GB), and this machine has no GPU, so nothing was installed; install the CPU build, then make install again: $$py -m pip install torch --index-url $(CPU_INDEX) (or a mirror of it, or a wheel file)"; exit 1; \
	  else echo "torch: pip's configured index offers no torch for this Python (pip install torch --dry-run failed; pip config list shows the index); install torch into $(VENV), then make install again"; exit 1; fi; \
	fi

demo: ## the built-in demo: non-private MLP on scikit-learn's digits, CPU, seconds
	$(PY) -m runner.cli

test: ## the default test suite (fast; slow sweeps are excluded)
	$(PY) -m pytest -q

lint: ## ruff with pyproject.toml's rules (pyflakes, pycodestyle errors); part of CI
	$(PY) -m ruff check .

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

.PHONY: bench-logical
bench-logical: ## a logical batch of 2,048 in chunks of 128 vs one pass of 128, and bf16 vs fp32, side by side -> outputs/bench/logical_<device>.csv
	$(PY) -m runner.bench.logical $(BENCH_ARGS)

.PHONY: bench-compare
bench-compare: ## this tree's steps vs another commit's (BASE=<commit>), interleaved step by step -> outputs/bench/compare_<device>.csv
	$(PY) -m runner.bench.compare --base $(or $(BASE),HEAD) $(BENCH_ARGS)

.PHONY: bench-profile
bench-profile: ## where a bench step's time goes, by operator (CPU self time; CUDA: its kernels' device time) -> outputs/bench/profile_<device>.csv
	$(PY) -m runner.bench.profile $(BENCH_ARGS)

.PHONY: bench-layout
bench-layout: ## each workload's steps in NCHW and channels-last side by side (one process), and what memory_format=auto picks -> outputs/bench/layout_<device>.csv
	$(PY) -m runner.bench.layout --suite gpu --quick --workloads cnn_mnist,papernot_cifar10,vgg11_cifar10,resnet18_cifar10 $(BENCH_ARGS)

.PHONY: bench-threads
bench-threads: ## each workload's steps with the backward on autograd's CUDA thread and in the calling thread, side by side (one process; the CPU: the same step twice) -> outputs/bench/threads_<device>.csv
	$(PY) -m runner.bench.threads --suite gpu --quick --workloads cnn_mnist,papernot_cifar10,transformer_imdb,resnet18_cifar10 $(BENCH_ARGS)

.PHONY: bench-syncs
bench-syncs: ## every synchronizing CUDA call of one step, by thread and innermost Python frames (torch's sync warn mode; the CPU: nothing to wait for) -> outputs/bench/syncs_<device>.csv
	$(PY) -m runner.bench.syncs --suite gpu --quick --workloads cnn_mnist,papernot_cifar10,transformer_imdb,resnet18_cifar10 $(BENCH_ARGS)

.PHONY: bench-search
bench-search: ## search every rule x setting for an input that releases more than C (restarts, gradient descent to cancellation, climbing; SEARCH_MINUTES, default 10); exit 1 on a violation -> outputs/bench/search_cpu.csv
	$(PY) -m runner.bench.violation_search --minutes $(SEARCH_MINUTES) $(BENCH_ARGS)
SEARCH_MINUTES ?= 10

.PHONY: bench-peak
bench-peak: ## what a bench step holds at its memory peak: each live tensor, its operator and line -> outputs/bench/peak_<device>.csv
	$(PY) -m runner.bench.peak $(BENCH_ARGS)

.PHONY: bench-dist
bench-dist: ## data-parallel steps/s and bytes all-reduced per step, 1 vs 2 processes (gloo on CPU) -> outputs/bench/distributed_cpu.csv
	$(PY) -m runner.bench.distributed --device cpu --nproc 1,2 $(BENCH_ARGS)

.PHONY: bench-gpu
bench-gpu: ## the GPU tables: bench-clip (+ Opacus, + compile rows), bench-jl, bench-logical, bench-dist over the GPUs -> outputs/bench/*_cuda.csv
	$(PY) -m runner.bench.clip --device cuda --suite gpu --compile reduce-overhead $(BENCH_ARGS)
	$(PY) -m runner.bench.jl --device cuda --suite gpu --memory --r 1,4 $(BENCH_ARGS)
	$(PY) -m runner.bench.logical --device cuda
	n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); [ "$$n" -gt 1 ] 2>/dev/null || n=1; \
	$(PY) -m runner.bench.distributed --device cuda --nproc $$( [ $$n -gt 1 ] && echo 1,$$n || echo 1)

.PHONY: bench-gpu-open
bench-gpu-open: ## the open issues' GPU rows in one short command (certified/lean step in fp32, tf32, bf16; secure noise; GPT-2-small) -> $(BENCH_OUT)/*/clip_cuda.csv
	mkdir -p $(BENCH_OUT)/fp32 && $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu --precision fp32 \
	  --workloads cnn_mnist,transformer_imdb,resnet18_cifar10,gpt2small_t128,gpt2small_t512 $(OPEN_RUNS) \
	  --methods nonprivate,reweight-bk,reweight-twopass,reweight-recompute,opacus-ghost --out $(BENCH_OUT)/fp32 $(BENCH_ARGS)
	for p in tf32 bf16; do mkdir -p $(BENCH_OUT)/$$p && $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu \
	  --precision $$p --workloads cnn_mnist,transformer_imdb,resnet18_cifar10,gpt2small_t128,gpt2small_t512 $(OPEN_RUNS) \
	  --methods nonprivate,reweight-bk --out $(BENCH_OUT)/$$p $(BENCH_ARGS) || exit 1; done
	mkdir -p $(BENCH_OUT)/secure && $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu \
	  --workloads cnn_mnist,transformer_imdb,resnet18_cifar10 $(OPEN_RUNS) \
	  --methods nonprivate,reweight-bk,reweight-bk-secure,noise-seeded,noise-secure --out $(BENCH_OUT)/secure $(BENCH_ARGS)
	if [ -d "$(BASE_TREE)/runner" ]; then mkdir -p $(BENCH_OUT)/compare $(BENCH_OUT)/compare_tf32 && $(PY) -m runner.bench.compare \
	  --device $(BENCH_DEVICE) --suite gpu --base $(BASE_TREE) --workloads transformer_imdb \
	  --methods nonprivate,reweight-bk,reweight-twopass,reweight-recompute $(OPEN_RUNS) --out $(BENCH_OUT)/compare \
	  $(BENCH_ARGS) && $(PY) -m runner.bench.compare --device $(BENCH_DEVICE) --suite gpu --base $(BASE_TREE) \
	  --precision tf32 --workloads cnn_mnist,resnet18_cifar10 --methods nonprivate,reweight-bk $(OPEN_RUNS) \
	  --pairs $(COMPARE_PAIRS) --out $(BENCH_OUT)/compare_tf32 $(BENCH_ARGS) && mkdir -p $(BENCH_OUT)/compare_aa && $(PY) -m runner.bench.compare \
	  --device $(BENCH_DEVICE) --suite gpu --base . --precision tf32 --workloads cnn_mnist,resnet18_cifar10 \
	  --methods nonprivate,reweight-bk $(OPEN_RUNS) --pairs $(COMPARE_PAIRS) --out $(BENCH_OUT)/compare_aa $(BENCH_ARGS); fi
COMPARE_PAIRS ?= 3

.PHONY: bench-gpu-compiled
bench-gpu-compiled: ## issue 31's compiled rows: a bk chunk as one graph under CUDA graphs vs the compiled non-private step, GPT-2-small at T=128/512, bf16 then fp32 (COMPILED_PRECISIONS: add bf16tc for the tensor-core route) -> $(BENCH_OUT)/compiled_*/clip_cuda.csv
	for p in $(COMPILED_PRECISIONS); do mkdir -p $(BENCH_OUT)/compiled_$$p && DPRUN_TENSOR_CORES=$$( [ $$p = bf16tc ] && echo 1 || echo 0 ) \
	  $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu --precision $${p%tc} --compile $(COMPILE_MODE) \
	  --workloads $(COMPILED_WORKLOADS) --methods nonprivate,reweight-bk $(OPEN_RUNS) \
	  --out $(BENCH_OUT)/compiled_$$p $(BENCH_ARGS) || exit 1; done

.PHONY: device-check
device-check: ## issue 31's GPU readings in one bounded call (~9 min on an H200; each step under its own timeout, so a step cut or failed keeps what it measured and does not stop the next; each step's output in $(BENCH_OUT)/check.log, at most 8 files under $(BENCH_OUT)): the event read probed once; the certified-clipping search on the GPU's kernels (device-search, 1 min); GPT-2-small's eager step in fp32 at T=128 and T=512 and in bf16 at T=128, the default (CUDA: Recorder, method.recorder=auto) beside the lean recorder, each with host_ms, its kernels' gpu_ms and mallocs (the compiled bf16 step, whose compilation overran 150 s at stop 63: make device-check-compiled). Issue 26's conv-net readings (met at stop 62): make device-check-conv
	mkdir -p $(BENCH_OUT) && { $(PY) -c "$$EVENT_READ_PROBE" $(BENCH_DEVICE) && echo 1 || echo 0; } | tail -1 > $(BENCH_OUT)/event_read \
	  && echo "device-check: DPRUN_EVENT_READ=$$(cat $(BENCH_OUT)/event_read)" | tee -a $(BENCH_OUT)/check.log
	-timeout -s INT -k 10 100 $(MAKE) --no-print-directory device-search DEVICE_SEARCH_MINUTES=1 BENCH_ARGS= 2>&1 | tee -a $(BENCH_OUT)/check.log
	-$(MAKE) --no-print-directory gpt2-rows T=128 P=fp32 SECONDS=140
	-$(MAKE) --no-print-directory gpt2-rows T=512 P=fp32 SECONDS=130 ROWS=nonprivate,reweight-bk,reweight-bk-lean ROW_REPEATS="--repeats 5 --warmup 2"
	-$(MAKE) --no-print-directory gpt2-rows T=128 P=bf16 SECONDS=130 ROWS=nonprivate,reweight-bk,reweight-bk-lean ROW_REPEATS="--repeats 5 --warmup 2"

.PHONY: gpt2-rows
gpt2-rows: ## (device-check) GPT-2-small's eager rows at T=$(T) in precision $(P), the default, the lean recorder and no kept per-example gradient (keep=0: ghost norms and one GEMM per clipped sum, less memory traffic than kept G_i), under a $(SECONDS) s limit
	mkdir -p $(BENCH_OUT)/check_gpt2_t$(T)_$(P) && DPRUN_EVENT_READ=$$(cat $(BENCH_OUT)/event_read) timeout -s INT -k 10 $(SECONDS) \
	  $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu --precision $(P) --workloads gpt2small_t$(T) \
	  --methods $(ROWS) $(ROW_REPEATS) --out $(BENCH_OUT)/check_gpt2_t$(T)_$(P) \
	  $(BENCH_ARGS) 2>&1 | tee -a $(BENCH_OUT)/check.log

.PHONY: device-check-conv
device-check-conv: ## issue 26's GPU readings (stop 62: met): the conv nets' and the transformer's bk step in one process (bench-clip, tf32), the default (Recorder on CUDA) against the lean recorder and its variants (every norm inside the backward, every norm after it, the kept G_i formed after it); the compare against .base (bench-compare, $(CHECK_PAIRS) pairs); papernot_cnn's bk step, default and lean, by the host's time per operator (bench-profile --host) -> $(BENCH_OUT)/check_*
	test -d "$(BASE_TREE)/runner" || { echo "device-check-conv: no $(BASE_TREE)/runner; run make base-tree here and carry $(BASE_TREE)"; exit 2; }
	mkdir -p $(BENCH_OUT) && { $(PY) -c "$$EVENT_READ_PROBE" $(BENCH_DEVICE) && echo 1 || echo 0; } | tail -1 > $(BENCH_OUT)/event_read
	-mkdir -p $(BENCH_OUT)/check_recorders && DPRUN_EVENT_READ=$$(cat $(BENCH_OUT)/event_read) $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu --precision tf32 \
	  --workloads $(CHECK_CONV_NETS),transformer_imdb --methods nonprivate,reweight-bk,reweight-bk-lean,reweight-bk-inline,reweight-bk-deferall,reweight-bk-late --repeats 30 --warmup 3 \
	  --out $(BENCH_OUT)/check_recorders $(BENCH_ARGS) 2>&1 | tee -a $(BENCH_OUT)/check.log
	-mkdir -p $(BENCH_OUT)/check_compare_tf32 && DPRUN_EVENT_READ=$$(cat $(BENCH_OUT)/event_read) $(PY) -m runner.bench.compare \
	  --device $(BENCH_DEVICE) --suite gpu --base $(BASE_TREE) --precision tf32 --workloads $(CHECK_CONV_NETS) --methods nonprivate,reweight-bk,reweight-bk-lean \
	  --pairs $(CHECK_PAIRS) --repeats 20 --warmup 3 --out $(BENCH_OUT)/check_compare_tf32 $(BENCH_ARGS) 2>&1 | tee -a $(BENCH_OUT)/check.log
	-mkdir -p $(BENCH_OUT)/check_host && DPRUN_EVENT_READ=$$(cat $(BENCH_OUT)/event_read) $(PY) -m runner.bench.profile --device $(BENCH_DEVICE) --suite gpu --precision tf32 \
	  --workloads papernot_cifar10 --methods reweight-bk,reweight-bk-lean --host --top 25 --out $(BENCH_OUT)/check_host $(BENCH_ARGS) 2>&1 | tee -a $(BENCH_OUT)/check.log

.PHONY: device-check-compiled
device-check-compiled: ## issue 31's compiled GPT-2-small bk step in bf16, with the tensor-core route's single clipped sum and without the route, on one card (~3 min on an H200; stop 43 read 1.43x with the single sum, the route-off row was cut), each row with its kernels' gpu_ms, both compiled steps' kernels by name with the single sum (bench-profile --by kernel: where the bk step's extra device time goes), then the route-off rows -> $(BENCH_OUT)/check_compiled_*
	-$(MAKE) --no-print-directory compiled-bf16-row TC=1 TC_SUM=single
	-mkdir -p $(BENCH_OUT)/check_compiled_kernels && DPRUN_TENSOR_CORES=1 DPRUN_TENSOR_CORES_SUM=single $(PY) -m runner.bench.profile \
	  --device $(BENCH_DEVICE) --suite gpu --precision bf16 --compile $(COMPILE_MODE) --by kernel --workloads gpt2small_t128 \
	  --methods nonprivate+compile,reweight-bk+compile --warmup 4 --repeats 3 --top 30 --out $(BENCH_OUT)/check_compiled_kernels \
	  $(BENCH_ARGS) 2>&1 | tee -a $(BENCH_OUT)/check.log
	-$(MAKE) --no-print-directory compiled-bf16-row TC=0 TC_SUM=split

.PHONY: compiled-bf16-row
compiled-bf16-row: ## (device-check-compiled) the compiled GPT-2-small bf16 rows with DPRUN_TENSOR_CORES=$(TC), DPRUN_TENSOR_CORES_SUM=$(TC_SUM)
	mkdir -p $(BENCH_OUT)/check_compiled_bf16_tc$(TC)_$(TC_SUM) && DPRUN_TENSOR_CORES=$(TC) DPRUN_TENSOR_CORES_SUM=$(TC_SUM) \
	  $(PY) -m runner.bench.clip --device $(BENCH_DEVICE) --suite gpu --precision bf16 --compile $(COMPILE_MODE) \
	  --workloads gpt2small_t128 --methods nonprivate,reweight-bk $(OPEN_RUNS) --out $(BENCH_OUT)/check_compiled_bf16_tc$(TC)_$(TC_SUM) \
	  $(BENCH_ARGS) 2>&1 | tee -a $(BENCH_OUT)/check.log
CHECK_CONV_NETS ?= cnn_mnist,papernot_cifar10,resnet18_cifar10
# gpt2-rows' contenders and repeats (stop 63 on an H200: T=512 and bf16 with 10 repeats and keep=0 overran their
# limits, each first step's checks taking tens of seconds; 5 repeats of three rows took ~70 s)
ROWS ?= nonprivate,reweight-bk,reweight-bk-lean,reweight-bk-keep0
ROW_REPEATS ?= --repeats 10 --warmup 3
# the step's event read (runner/norms/certify.py read_started) tried once on the device: if it fails, the checks run
# with the plain read (DPRUN_EVENT_READ=0) instead of failing every bk row
export EVENT_READ_PROBE = import sys, torch; from runner.norms import certify; \
  k = torch.ones(4, dtype=torch.bool, device=sys.argv[1]); s = certify.read_started(k); \
  assert certify.every_record_kept(k, s) and (s is not None or k.device.type != "cuda")
CHECK_PAIRS ?= 2

.PHONY: device-search
device-search: ## the certified-clipping search (bench-search) on a GPU's own kernels, the settings whose arithmetic differs there: TF32, bf16, the tensor-core route in both sums (~2 min) -> $(BENCH_OUT)/check_search/search_cuda.csv
	-mkdir -p $(BENCH_OUT)/check_search && $(PY) -m runner.bench.violation_search --device $(BENCH_DEVICE) \
	  --minutes $(DEVICE_SEARCH_MINUTES) --settings "$(DEVICE_SEARCH_SETTINGS)" --out $(BENCH_OUT)/check_search $(BENCH_ARGS)
DEVICE_SEARCH_MINUTES ?= 2
DEVICE_SEARCH_SETTINGS ?= reweight (defaults: bk, auto),bk tf32,bk bf16,bk recorder full,bk late on,bk bf16 tensor cores split,bk bf16 tensor cores single

COMPILE_MODE ?= reduce-overhead
COMPILED_PRECISIONS ?= bf16 fp32
COMPILED_WORKLOADS ?= gpt2small_t128,gpt2small_t512
OPEN_RUNS = --repeats 10 --warmup 3 --budget 2
BENCH_OUT ?= outputs/bench/open
BENCH_DEVICE ?= cuda
# the tree bench-gpu-open compares this one with, step by step, where it exists (a device machine has no .git:
# export it first, `make base-tree`, and carry .base)
BASE_TREE ?= .base
BASE_COMMIT ?= 0c009e4

.PHONY: base-tree
base-tree: ## export commit BASE_COMMIT (default 0c009e4, before certified clipping) into .base/ for bench-gpu-open's before/after
	rm -rf $(BASE_TREE) && mkdir -p $(BASE_TREE) && git archive $(BASE_COMMIT) | tar -x -C $(BASE_TREE)

# --- figures and tables ---
# make figures SCALE=smoke (default; CPU minutes) | SCALE=paper (the papers' hyperparameters, for a GPU).
# Each fig-<name>: the preset's Hydra sweeps (runner/figures/sweep.py), dprun-report, then the plot (docs/figures.md).
# SWEEP_ARGS go to every dprun of a sweep, e.g. SWEEP_ARGS="launcher=slurm" or "device=cuda data_dir=/data".
FIGURES_TRAINED := jl_fig3 jl_table2 jl_fig1 jl_fig4 jl_table3 jl_fig5 jl_fig6 lk_fig5 lk_fig6 lk_fig7 jl_table5 lk_fig8 lk_fig9 lk_memory
FIGURES_COMPUTED := jl_table1 jl_fig2 jl_fig7 jl_table4 jl_epsilon_r sbcd_hsa_vs_composition sbcd_epoch_contribution sbcd_adaptive_noise
TABLES := jl_table1 jl_table2 jl_table3 jl_table4 jl_table5
SWEEP_ARGS ?=
REPORT = $(PY) -m runner.report --quiet && $(PY) -m runner.report --epochs --quiet
.PHONY: figures tables report plots figures-list memory-study audit

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

audit: ## claimed vs audited epsilon (one-run audit, docs/audit.md): digits, CPU minutes -> outputs/figures/audit.png (AUDIT_ARGS="--dataset mnist --epochs 15 --device cuda")
	$(PY) -m runner.figures.audit $(AUDIT_ARGS)

figures-list: ## the figure names, the preset each reads, and its estimated GPU time at scale=paper
	$(PY) -m runner.plots --list
