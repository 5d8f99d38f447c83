"""`make torch` (the first step of `make install`) with a fake venv python, a fake pip and, where wanted, a fake
nvidia-smi: which torch it installs, from where, and what it says. Nothing is downloaded."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

# the venv's python: no torch; the index probe and pip are fakes that log their arguments; anything else is Python
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$*" in
  *"import torch"*) exit 1 ;;
  *urllib.request*) exit "$FAKE_PROBE" ;;
  *--dry-run*) cat "$FAKE_REPORT"; exit 0 ;;
  "-m pip index versions torch") echo "torch (2.14.1)"; echo "Available versions: $FAKE_VERSIONS"; exit 0 ;;
  "-m pip install"*) exit 0 ;;
  *) exec "{python}" "$@" ;;
esac
"""


def report(version: str, *extra: str) -> dict:
    """What `pip install torch --dry-run --report -` prints, reduced to what the Makefile reads."""
    return {"install": [{"metadata": {"name": name, "version": v}} for name, v in
                        [("torch", version), ("filelock", "3.0"), *[(e, "12.0") for e in extra]]]}


def make_torch(tmp_path, *, gpu=False, reachable=True, offered=report("2.13.0+cpu"), torch_index=None,
               versions="2.14.1, 2.14.0, 2.13.0"):
    venv, fakebin = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    fakebin.mkdir()
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    if gpu:
        (fakebin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
        (fakebin / "nvidia-smi").chmod(0o755)
    (tmp_path / "report.json").write_text(json.dumps(offered))
    env = {**os.environ, "PATH": f"{fakebin}:/usr/bin:/bin", "FAKE_LOG": str(tmp_path / "log"),
           "FAKE_PROBE": "0" if reachable else "1", "FAKE_REPORT": str(tmp_path / "report.json"), "FAKE_VERSIONS": versions}
    args = ["make", "-s", "-C", str(ROOT), "torch", f"VENV={venv}"] + ([f"TORCH_INDEX={torch_index}"]
                                                                       if torch_index is not None else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    log = (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []
    installs = [ln for ln in log if ln.startswith("-m pip install -q torch")]
    return proc, installs


def test_no_gpu_and_the_cpu_index_reachable_installs_from_it_quietly(tmp_path):
    proc, installs = make_torch(tmp_path)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    assert installs == ["-m pip install -q torch --index-url https://download.pytorch.org/whl/cpu"]


def test_an_unreachable_cpu_index_is_one_line_then_a_cpu_build_from_pips_index(tmp_path):
    proc, installs = make_torch(tmp_path, reachable=False, offered=report("2.13.0+cpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and "https://download.pytorch.org/whl/cpu is unreachable" in lines[0]
    assert "installing torch 2.13.0+cpu, a CPU build, from pip's configured index" in lines[1]
    assert installs == ["-m pip install -q torch"]


@pytest.mark.parametrize("torch_index,reachable", [("", True), (None, False)])
def test_the_cuda_build_is_never_installed_without_a_gpu(tmp_path, torch_index, reachable):
    """TORCH_INDEX= (or an unreachable CPU index) with pip's index offering PyPI's CUDA build: refused in one line
    that gives the command for the CPU build; nothing installed."""
    proc, installs = make_torch(tmp_path, reachable=reachable, torch_index=torch_index,
                                offered=report("2.14.1", "nvidia-cublas-cu12", "nvidia-cudnn-cu12"))
    assert proc.returncode != 0 and installs == []
    ours = [ln for ln in proc.stdout.splitlines() if "CUDA build" in ln]
    assert len(ours) == 1 and "torch 2.14.1" in ours[0] and "no GPU" in ours[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in ours[0]


def test_a_cpu_build_the_index_also_lists_is_installed_instead_of_its_default_cuda_build(tmp_path):
    """This machine's pip: `pip install torch` resolves to the newest torch, the CUDA build, but the index also
    carries an older CPU build (`pip index versions torch` lists 2.13.0+cpu): that one is installed, in one line."""
    proc, installs = make_torch(tmp_path, reachable=False, offered=report("2.14.1", "nvidia-cublas-cu12"),
                                versions="2.15.0, 2.14.1, 2.13.0+cpu, 2.13.0, 2.12.0+cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and "unreachable" in lines[0]
    assert "torch 2.14.1, the CUDA build, by default, and also torch 2.13.0+cpu, a CPU build" in lines[1]
    assert installs == ["-m pip install -q torch==2.13.0+cpu"]


def test_a_gpu_gets_pypis_cuda_build(tmp_path):
    proc, installs = make_torch(tmp_path, gpu=True)
    assert proc.returncode == 0 and "GPU" in proc.stdout
    assert installs == ["-m pip install -q torch"]
