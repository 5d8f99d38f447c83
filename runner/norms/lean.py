"""Book-keeping's lean recorder (issue 31): each layer's norm formed INSIDE the one backward, and only what the
clipped sums need kept.

    stashes = {}
    with LeanRecorder(plan, how, stashes) as lean:
        losses = loss_fn(model(x), y)                  # forward hooks keep each call's input, hook its output
    norms_sq = lean.backward(losses.sum(), len(y))     # (B,) certified; None: a call the backward did not reach
    for path, module, rule, calls in lean.raw_layers():  # what each layer's clipped sum is formed from
        ...; lean.release(module)

Recorder (hooks.py) keeps every call's output until the backward ends and gets all output-gradients at its end
from autograd.grad(loss, outputs), so the outputs (which autograd itself would have freed) and every
output-gradient pile up next to each other. Here, as in StreamingNorms (streaming.py, which it extends), a tensor
hook on each call's output receives the output-gradient as the backward reaches the layer; once a module has all of
its calls' gradients, its certified squared norm is formed (runner/norms/certify.py) with the rule's stash. Small
layers are the exception (streaming.CAPTURE_BYTES): a module called once whose output, with the other such calls',
stays within 2 MiB gets no hook; the backward returns its output-gradient by the output's gradient edge and its norm
follows the backward (a hook and a norm inside the backward cost small layers more than they save). Then:

- the outputs are never kept (the hook lives on the graph, not on the tensor);
- a layer whose stash holds every parameter's per-example gradient or sum (rule.stash_only: a Linear that keeps
  G_i, a LayerNorm's per-example sums, a conv that keeps G_i and its bias sums unless norms are deferred) drops its
  inputs and output-gradients at once: the clipped sum adds the stashed tensors, the very ones measured (the
  certificate is theirs);
- any other layer keeps its raw (input, output-gradient) records, no upcast or concatenated copy, until its clipped
  sum is formed (exactly what Recorder.raw_layers gives).

On CUDA (method.defer, runner/methods/reweight.py), a layer whose records the clipped sum keeps anyway (RECORDS_KEPT:
it was not stash_only at its last call of these shapes) is captured too, whatever its size and without its output
held: its norm follows the backward, from the output-gradient autograd returns for its edge. Those bytes are held for
the clipped sum either way; what can grow is the peak where a deferred norm's transients (a conv's unfolded input)
meet every layer's output-gradient at the backward's end (papernot_cnn at B = 32 on the CPU: 53.4 against 47.1 MB;
bu_cnn, ResNet-18, the LSTM and the transformer: the same peak). It gives the GPU the backward's kernels before the
norms', and a host-bound GPU step no Python between them (stop 44, docs/bench.md).

The backward asks for the source calls' outputs (and the captured calls') only (StreamingNorms.backward, graph freed
as it goes). A hooked call it did not reach (input data that requires grad, an unused output) leaves `complete` False and backward returns
None: the caller then replays the step with Recorder (ReweightGP does, and keeps Recorder for that model).
"""
from __future__ import annotations

import torch

from runner.norms.certify import certified_norms, exact_float32
from runner.norms.coverage import Plan
from runner.norms.late import LateLayers, goes_late
from runner.norms.outer import KEEP, Stash
from runner.norms import streaming
from runner.norms.streaming import StreamingNorms
from runner.norms.tensor_cores import records

# book-keeping cuts one call's norm into chunks of examples when its transients (a conv's unfolded input, Grams, a
# per-example gradient) exceed this many times the call's own records: bu_cnn's conv1 im2col at B=256 is 12.3 MB,
# 3.9x its input and output-gradient, and was the whole bk step's memory peak (1.26x the non-private step's in
# channels-last; stop 38). Looser than twopass's TRANSIENT_BUDGET: a transformer's feed-forward Grams (1.3x) stay
# whole, where chunks would add kernels and save nothing (its peak is the attention's backward)
BK_TRANSIENT_BUDGET = 3.0
# ... and only where one call's transients exceed this many bytes (twopass's floor is 1 MiB): each chunk adds ~15-30
# operators, which a small step pays for (L&K's fig. 6 CNN at B=16 would have cut conv2 into 3 chunks, +18 kernels on
# a 94-kernel step, tests/test_kernel_budget.py). bu_cnn's conv1 at B=256 (17 MB) is cut in two: ~0.35 ms on its CPU
# step (3%) for 1.26x -> 1.13x the non-private step's memory (channels-last; stop 38)
BK_FLOOR_BYTES = 2**23
# on a GPU, only above this: a small model's CUDA step is bound by the host's launches (stop 32: bu_cnn's device time
# < 10% of its step) while a few MB do not matter there (chunks on a GPU: not measured yet)
BK_CUDA_FLOOR_BYTES = 2**28
CHUNKS: dict = {}  # (module, shapes, dtype, device type) -> examples per chunk (LeanRecorder._chunk)
# (module, input and output shapes, dtype, device type) -> whether the layer's clipped sum needed its records the last
# time it was called once with these shapes (not stash_only): LeanRecorder(defer="kept") then forms its norm after the
# backward. A stale entry could only move a norm in time (and its transients), never change it
RECORDS_KEPT: dict = {}


class LeanRecorder(StreamingNorms):
    def __init__(self, plan: Plan, how: str, stashes: dict, keep=KEEP, capture_bytes: int | None = None,
                 defer: str = "off", late: bool = False):
        # calls whose outputs add up to at most capture_bytes (default streaming.CAPTURE_BYTES) get no tensor hook
        super().__init__(plan, how, streaming.CAPTURE_BYTES if capture_bytes is None else capture_bytes)
        self.stashes = stashes  # id(module) -> the rule's stash (kept per-example gradients or sums)
        self.keep = keep  # method.keep's ratio or method.keep_mb's budget (Stash.keeps)
        self.kept: dict[int, list] = {}  # id(module) -> [(input, output-gradient)] for its clipped sum ([] if stash)
        # method.defer: "kept", a layer whose records the clipped sums keep anyway (RECORDS_KEPT) gets no hook; its
        # norm is formed after the backward from the output-gradient autograd returns (held for the clipped sum
        # anyway); "all", every layer called once (the stash-only layers' records then wait too); "off", none
        if defer not in ("off", "kept", "all"):
            raise ValueError(f"LeanRecorder defer={defer!r}: off, kept or all")
        self.defer = defer
        # late: a Linear called once whose G_i the stash would keep gets no hook, and its norm and clipped sum are
        # formed after the backward, chunk by chunk (runner/norms/late.py): G_i never adds to the backward's peak
        self.late = LateLayers(how, keep) if late else None
        self.late_keys: set[int] = set()  # id(module) of the calls sent late (goes_late, at their first call)

    def defers(self, module, inp: torch.Tensor, out: torch.Tensor) -> bool:
        """defer "kept": a layer called once that kept its records the last time (RECORDS_KEPT), "all": any layer's
        first call: its norm after the backward, so the backward's kernels are all launched before the norms' (a GPU
        step bound by its host launches them in the order 0c009e4 did; each norm inside the backward runs Python
        between its kernels)."""
        if self.late is not None and goes_late(module, inp, out, self.how, self.keep):
            self.late_keys.add(id(module))
            return True
        if self.defer == "all":
            return True
        return self.defer == "kept" and RECORDS_KEPT.get(signature(module, inp, out), False)

    def _add(self, key: int) -> None:
        path, module, rule, inputs, grads = self._calls(key)
        if key in self.late_keys and len(inputs) == 1:  # its norm and clipped sum after the backward (finish)
            self.late.add(path, module, rule, inputs[0], grads[0])
            self.layers += 1
            return
        stash = self.stashes.setdefault(key, Stash(self.keep, key, defers=self.defer != "off"))
        # bf16: the norm and the clipped sum are formed from the same float32 upcasts (as Recorder), or the same
        # bf16 records on a GPU's tensor cores (a Linear: runner/norms/tensor_cores.py)
        recs = [records(i, g, rule.tensor_cores and self.tensor_cores) for i, g in zip(inputs, grads)]
        with exact_float32(grads[0].device):  # a rule's route from the raw records (a conv's kept G_i by rows)
            direct = rule.records_norm_sq(module, *recs[0], self.how, stash) if len(recs) == 1 else None
        if direct is not None:
            self._accumulate(direct.detach())  # (B,) certified bounds
            seq = a = g = None
        elif (chunk := self._chunk(rule, module, inputs, grads, stash)) < inputs[0].shape[0]:
            # one call, transients (a conv's im2col) cut by examples (BK_TRANSIENT_BUDGET)
            self._add_chunked(module, rule, recs[0], stash, chunk)
            seq = a = g = None
        else:
            seq = [rule.sequence(module, *r) for r in recs]
            a = torch.cat([s[0] for s in seq], 1) if len(seq) > 1 else seq[0][0]  # (B, T, ...): calls along T
            g = torch.cat([s[1] for s in seq], 1) if len(seq) > 1 else seq[0][1]
            with exact_float32(g.device):
                self._accumulate(rule.norm_sq(module, a, g, self.how, stash).detach())  # (B,) certified bounds
        if rule.stash_only(module, stash):
            self.kept[key] = []
        elif seq is not None and len(seq) > 1 and rule.sequence_is_call and a.dtype == inputs[0].dtype:
            # a module called many times (a recurrent cell's h_proj, T calls): the concatenated (a, g) the norm was
            # formed from, kept as one call, so its clipped sum is one GEMM over B*T rows, not T small ones; the
            # same bytes as the T records (which the backward may now free)
            self.kept[key] = [(a, g)]
        else:
            self.kept[key] = list(zip(inputs, grads))
        if len(inputs) == 1:
            if len(RECORDS_KEPT) > 4096:
                RECORDS_KEPT.clear()
            RECORDS_KEPT[signature(module, inputs[0], grads[0])] = bool(self.kept[key])
        del seq, a, g

    def _chunk(self, rule, module, inputs: list, grads: list, stash: Stash) -> int:
        """Examples per norm chunk: the batch, unless one call's norm transients exceed BK_TRANSIENT_BUDGET times
        its records and BK_FLOOR_BYTES (BK_CUDA_FLOOR_BYTES on a GPU). A per-step budget (method.keep_mb) decides
        per call with the batch's N: no chunks then."""
        if len(inputs) > 1 or not isinstance(stash.keep, (int, float)):
            return inputs[0].shape[0]
        # the same shapes every step: sized once (chunk_size builds one example's (a, g): a conv's unfold, kernels a
        # host-bound GPU step would pay each step). A stale entry could only change the chunk size, never the norms
        key = (id(module), type(module), tuple(inputs[0].shape), tuple(grads[0].shape), inputs[0].dtype,
               inputs[0].device.type)
        if key not in CHUNKS:
            if len(CHUNKS) > 4096:
                CHUNKS.clear()
            floor = BK_CUDA_FLOOR_BYTES if inputs[0].is_cuda else BK_FLOOR_BYTES
            CHUNKS[key] = streaming.chunk_size(rule, module, inputs, grads, floor, budget=BK_TRANSIENT_BUDGET)
        return CHUNKS[key]

    def _add_chunked(self, module, rule, rec: tuple, stash: Stash, chunk: int) -> None:
        """One call's norm over chunks of examples (per-example norms are independent: exact), each with a stash of
        its own (the keep rule is a ratio: the same choice in every chunk), then joined along the batch."""
        inp, grad = rec
        parts, subs = [], []
        for start in range(0, inp.shape[0], chunk):
            rows = slice(start, start + chunk)
            a, g = rule.sequence(module, inp[rows], grad[rows])
            subs.append(Stash(stash.keep, stash.key, stash.defers))
            with exact_float32(g.device):
                parts.append(rule.norm_sq(module, a, g, self.how, subs[-1]).detach())  # (chunk,) certified
            del a, g
        for name in subs[0]:
            stash[name] = torch.cat([sub[name] for sub in subs])  # (B, ...) the very tensors measured
        self._accumulate(torch.cat(parts))

    def backward(self, loss: torch.Tensor, batch_size: int, keep_graph: bool = False) -> torch.Tensor | None:
        """The one backward of book-keeping, graph freed as it goes; (B,) squared norms, or None if incomplete."""
        return super().backward(loss, batch_size, keep_graph=False)

    def finish(self, early_sq: torch.Tensor, clip_factors) -> tuple:
        """After backward: (B,) certified norms, (B,) clip factors and the late layers' {id(parameter): clipped sum}
        (runner/norms/late.py); early_sq is backward's (B,) sum of the other layers' bounds."""
        if self.late is None or not len(self.late):
            norms = certified_norms(early_sq, self.layers)
            return norms, clip_factors(norms), {}
        if not self.terms:  # every layer late: start from zeros of their records' dtype, not the loss's (float64
            early_sq = torch.zeros_like(early_sq, dtype=self.late.records[0][3].dtype)  # loss: review 33)
        return self.late.finish(early_sq, self.layers, clip_factors)

    def raw_layers(self):
        """(path, module, rule, [(input, output-gradient) per call], upcast to float32) per covered module that was
        called, in the plan's order; [] for a module whose stash alone gives its clipped sums."""
        for path, module, rule in self.plan.layers:
            calls = self.kept.get(id(module))
            if calls is not None:
                yield path, module, rule, [records(i, g, rule.tensor_cores and self.tensor_cores) for i, g in calls]

    def release(self, module) -> None:
        """Free a module's records once its clipped sum is formed."""
        self.kept.pop(id(module), None)


def signature(module, inp: torch.Tensor, out: torch.Tensor) -> tuple:
    """RECORDS_KEPT's key for one call: the module, its input's and output's (or output-gradient's) shapes, the
    input's dtype and device type."""
    return id(module), type(module), tuple(inp.shape), tuple(out.shape), inp.dtype, inp.device.type
