"""python -m runner.bench.threads: each row with the backward on autograd's device thread and in the calling thread,
side by side in one process (runner/backward_thread.py's switch, put back after every step)."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from runner import backward_thread
from runner.bench import threads
from runner.errors import DprunError


def test_both_threads_are_timed_in_one_process(tmp_path):
    table = threads.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods",
                          "nonprivate,reweight-bk", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path)])
    saved = pd.read_csv(tmp_path / "threads_cpu_quick.csv")
    assert list(saved.method) == ["nonprivate", "reweight-bk"] and len(table) == 2
    assert (saved.worker_ms > 0).all() and (saved.caller_ms > 0).all()
    assert (saved.caller_over_worker - saved.caller_ms / saved.worker_ms).abs().max() < 1e-9
    assert backward_thread.IN_CALLING_THREAD  # the bench put the setting back


@pytest.mark.parametrize("flag", [True, False])
def test_each_column_steps_with_its_own_setting_on_cuda(flag):
    """What the step's context would be on CUDA inside each column's step (no GPU needed to build it)."""
    inside = []

    def step():
        with backward_thread.backward_in_this_thread(torch.device("cuda")):
            inside.append(torch.autograd.is_multithreading_enabled())
        inside.append(backward_thread.IN_CALLING_THREAD)

    threads.in_thread(step, flag)()
    assert inside == [not flag, flag] and backward_thread.IN_CALLING_THREAD


def test_an_unknown_row_is_one_line():
    with pytest.raises(DprunError, match="unknown row .reweight-bk\\+compile."):
        threads.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods", "reweight-bk+compile"])
