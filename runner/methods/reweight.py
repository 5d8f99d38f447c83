"""ReweightGP (Lee & Kifer section 5): exact per-example norms from each layer's inputs and output-gradients.

One forward records every covered layer's input and output (runner/norms/hooks.py); one backward of
sum_i loss_i gives the output-gradients, which are per example because the loss is a sum. The per-layer rules
(runner/norms/) give squared norms, summed over layers: norm_i. With nu_i = min(1, C/(norm_i + 1e-6)):

    method.mode=bk        (default) book-keeping (Bu et al. 2023): each layer's clipped sum sum_i nu_i grad_i
                          is formed directly from the stored inputs and output-gradients; no second backward
    method.mode=twopass   the paper's two backwards: the norms are formed in the first, layer by layer
                          (runner/norms/streaming.py), then the same backward runs again through the kept graph
                          and each layer's clipped sum is formed from its output-gradients as they arrive, with
                          the first pass's clip factors (runner/norms/released.py: not the paper's backward of
                          sum_i nu_i loss_i, which rounds differently and released 17.6 C through a GroupNorm,
                          review 25); one layer's records at a time, about the non-private step's memory
                          (book-keeping keeps every layer's output-gradient: ~2x on ResNets)
    method.mode=recompute twopass without keeping the graph: the first backward frees each activation as it goes
                          (as a non-private backward does), then the forward runs again, with torch's random state
                          replayed (the same dropout masks), for the backward that forms the clipped sums. One more forward per
                          step buys the non-private step's memory on small CNNs too, where keeping the graph costs
                          the early frees of the backward (twopass 1.4x on bu_cnn)
    method.norm=auto|direct|ghost   per layer, for sequence and conv inputs: the cheaper of materialising the
                          per-example gradient and the ghost norm sum_{t,s} (a_t.a_s)(g_t.g_s)

    dprun method=reweight dataset=digits epochs=3 sigma=1.0 clip=1.0
    dprun method=reweight method.mode=twopass method.norm=ghost model=lstm dataset=mnist
"""
from __future__ import annotations

import logging

import torch

from runner.errors import DprunError
from runner.methods.base import METHODS, Method, Privatized
from runner.methods.rng import rng_state, set_rng_state
from runner.methods.features import Feature
from runner.norms import Recorder, plan_model
from runner.norms.lean import LeanRecorder
from runner.norms.hooks import install_call_hooks
from runner.norms.keep_budget import KeepBudget, keep_budget
from runner.norms.outer import KEEP, Stash
from runner.norms.released import ReleasedSums
from runner.norms.streaming import StreamingNorms, summed_terms
from runner.norms.base import HOW
from runner.norms import certify
from runner.norms.certify import certified_norms, clipped_sums_of, exact_float32

MODES = ("bk", "twopass", "recompute")
# bk: lean = each layer's norm inside the backward, only what the clipped sums need kept (runner/norms/lean.py, issue
# 31's memory); full = Recorder, every output-gradient at the backward's end and the norms after it (the order before
# issue 31: more memory; on a GPU its backward runs no Python between kernels); auto = full on CUDA (an H200, stop 62:
# 0.77-0.93x the uncertified tree's step on bu_cnn, papernot_cnn, ResNet-18 and the transformer, where lean read
# 0.86-1.07x; docs/bench.md "On an H200 (stop 62)"), unless one of the lean recorder's own settings is asked for
# (method.defer, method.late, method.keep, method.keep_mb); lean elsewhere
RECORDERS = ("auto", "lean", "full")
# bk, lean recorder: the norms of layers whose records the clipped sums keep anyway formed after the backward (on: no
# record more, and the backward's kernels launched before the norms', the order a GPU's host-bound step wants) or as
# each output-gradient arrives (off: on the CPU the gradient is still in cache); all: every layer's after the backward
# (the stash-only layers' records then wait too: Recorder's order, without its kept outputs); auto: on on CUDA, off
# elsewhere
DEFERS = ("auto", "on", "off", "all")
LATES = ("auto", "on", "off")
log = logging.getLogger("dprun")


def one_dtype(params: list, name: str) -> None:
    """Every trained weight in one dtype: the clip factors come from norms summed over all layers (float64 when any is)
    and weight each layer's records in that dtype (review 61: a float32 layer beside a float64 one crashed the
    clipped sums with a dtype mismatch). nxbp and multiloss clip each example's gradient per parameter."""
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    if len(dtypes) > 1:
        raise DprunError(f"method={name} trains weights of one dtype; this model's trained weights are "
                         f"{' and '.join(dtypes)}: cast the model to one (model.float() or model.double()), or use "
                         f"method=nxbp or multiloss, which take mixed dtypes")


def keep_ratio(value) -> float:
    """method.keep: a number >= 0 (book-keeping keeps a layer's per-example gradient up to this many times the
    records it replaces; 0 never keeps one)."""
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = -1.0
    if not ratio >= 0:
        raise DprunError(f"method.keep={value!r} is not valid: a number >= 0 (0: keep no per-example gradient, "
                         f"{KEEP}: the default, larger: trade memory for time)")
    return ratio


@METHODS.register("reweight")
class ReweightGP(Method):
    name = "reweight"
    summary = "ReweightGP: per-example norms from layer inputs and output-gradients, then one re-weighted sum"
    compiles = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode = self.choice("mode", "bk", MODES)
        self.how = self.choice("norm", "auto", HOW)
        self.recorder = self.choice("recorder", "auto", RECORDERS)  # bk: where each layer's norm is formed
        self.defer = self.choice("defer", "auto", DEFERS)  # bk lean: record-keeping layers' norms after the backward
        self.late = self.choice("late", "auto", LATES)  # bk lean: kept G_i formed after the backward (late.py)
        budget = keep_budget(self.option("keep_mb", None))  # method.keep_mb replaces method.keep's ratio
        self.keep = budget if budget is not None else keep_ratio(self.option("keep", KEEP))
        # the lean recorder's own settings, asked for: method.recorder=auto then takes it on CUDA too (its keep rules
        # free records inside the backward; Recorder holds every output-gradient to its end: keep=0 on the bench
        # transformer 74.35 MB lean, 120.87 MB with Recorder, review 34)
        self.asks_lean = (self.defer != "auto" or self.late != "auto" or budget is not None
                          or self.keep != KEEP)
        self._plan, self._model_id = None, None
        self._lean = True  # book-keeping's lean recorder, until a model needs Recorder (book_kept)
        self._recorder_fits = True  # False once Recorder, auto's choice on CUDA, ran out of memory (book_kept)

    def lean_on(self, device: torch.device) -> bool:
        """Does an eager bk step on `device` start with the lean recorder? method.recorder=auto: on the CPU, where
        one of the lean recorder's own settings is asked for (method.defer or method.late other than auto,
        method.keep other than its default, method.keep_mb), or where Recorder ran out of memory; Recorder on CUDA."""
        if self.recorder != "auto":
            return self.recorder == "lean"
        return device.type != "cuda" or self.asks_lean or not self._recorder_fits

    def deferral(self, device: torch.device) -> str:
        """method.defer for a step on `device` as LeanRecorder takes it: off, kept (the record-keeping layers') or
        all; auto is kept on CUDA, off elsewhere."""
        if self.defer == "auto":
            return "kept" if device.type == "cuda" else "off"
        return {"on": "kept"}.get(self.defer, self.defer)

    def goes_late(self, device: torch.device) -> bool:
        """method.late for a bk step on `device`: auto is on on the CPU, off on CUDA (each chunk adds kernels, and a
        GPU step of a small model is bound by its launches: not measured on a GPU yet)."""
        return self.late == "on" or (self.late == "auto" and device.type != "cuda")

    def defers(self, device: torch.device) -> bool:
        """Does a bk step on `device` defer any norm (from its second step on)?"""
        return self.deferral(device) != "off"

    def prepare(self, model, data=None):
        self.plan(model)
        return model

    def backward_holds_records(self) -> bool:
        """twopass: its second backward runs through the first forward's graph (runner/methods/dropped.py);
        recompute: through its second forward's, over the same rows."""
        return self.mode in ("twopass", "recompute")

    def exact_under_tf32(self) -> bool:
        """bk: the records carry TF32's rounding, but the norms and the clipped sums are formed from them in float32
        (exact_float32). twopass/recompute: their second pass must give the first pass's output-gradients bit for bit
        (runner/norms/released.py), which cuDNN's choice of TF32 algorithms does not promise (not measured)."""
        return self.mode == "bk"

    def unsupported(self, feature: Feature) -> str | None:
        if feature is Feature.BF16 and self.mode != "bk":
            return (f"method.mode={self.mode} forms its norms from the bf16 records as they are, without "
                    f"book-keeping's float32 upcasts shared by the norm and the sum (not built for this mode); use "
                    f"method.mode=bk (it sums the very tensors whose norms it took)")
        return None

    def plan(self, model, params: list | None = None):
        """The model's covered layers; re-checked whenever the set of trainable parameters changes (params:
        trainable(model), when the caller has it: one walk of the modules fewer)."""
        if self._plan is None or self._model_id != id(model) or not self._plan.matches(model, params):
            self._plan, self._model_id = plan_model(model), id(model)
            self._lean = True
            if not torch.compiler.is_compiling():
                install_call_hooks(self._plan)  # no hook registered inside a compiled step (runner/norms/hooks.py)
        return self._plan

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        params = self.trainable(model)
        one_dtype(params, self.name)
        plan = self.plan(model, params)
        consistent = None  # twopass/recompute: their second pass's records within the first's norms (released.py)
        if self.mode == "recompute":
            outputs, losses, norms, consistent = self.recomputed(plan, params, model, loss_fn, x, y)
        elif self.mode == "twopass":
            # the second pass runs through the kept graph: a record that is not finite (nu = 0) has its rows masked
            # in the sums, and Method.clipped_sum forms the chunk again without it (backward_holds_records)
            with StreamingNorms(plan, self.how, remember="calls") as streaming:
                outputs = model(x)  # (B, classes)
                losses = loss_fn(outputs, y)  # (B,)
            norms = certified_norms(streaming.backward(losses.sum(), len(y)), streaming.layers)  # (B,); graph kept
            nu = self.clip_factors(norms)  # (B,); 0 for a record whose norm is not finite
            release = ReleasedSums.through_graph(streaming, nu)
            self.assign(params, release.run(losses.sum(), len(y), graph_kept=True))
            consistent = release.agrees()
        else:
            outputs, losses, norms = self.book_kept(plan, params, model, loss_fn, x, y)
        if not plan.matches(model):
            raise DprunError("the model's trainable parameters changed during the step; every trainable "
                             "parameter must be covered by a norm rule")
        return Privatized(losses.detach(), outputs.detach(), norms, consistent)

    def book_kept(self, plan, params, model, loss_fn, x, y):
        """Book-keeping: one forward, one backward, each layer's clipped sum from its records (book_keeping).
        Eager, lean recorder (method.recorder=lean, or auto off CUDA): the lean recorder (runner/norms/lean.py, issue
        31) forms each layer's norm inside the backward and keeps only what the clipped sums need; a covered call its source-only
        backward did not reach makes the step start again (same random state) with Recorder, which asks autograd for
        every call's output-gradient, and this model keeps Recorder from then on; method.recorder=full (auto on
        CUDA) takes Recorder from the start (recorded); where auto's Recorder runs out of memory, in the forward, the
        backward, the norms or the sums, the step starts again (same random state; p.grad is assigned only when every
        sum is formed) with the lean recorder, which this method keeps from then on. Compiled
        (runner/methods/compiled.py, self.traced): Recorder, no tensor hooks in the traced graph, which is then one
        graph with the backward in it."""
        stashes: dict[int, dict] = {}
        if isinstance(self.keep, KeepBudget):
            self.keep.begin_step()
        if self._lean and self.lean_on(x.device) and not self.traced and not torch.compiler.is_compiling():
            state = rng_state(x.device)
            with LeanRecorder(plan, self.how, stashes, self.keep, defer=self.deferral(x.device),
                              late=self.goes_late(x.device)) as rec, \
                    self.autocast(x):
                outputs = model(x)  # (B, classes)
                losses = loss_fn(outputs, y)  # (B,)
            norms_sq = rec.backward(losses.sum(), len(y))  # (B,) certified; None: a call it did not reach
            if norms_sq is not None:
                # (B,) norms and clip factors (0 for a record whose norm is not finite); the late layers' G_i are
                # formed here, with their clipped sums (runner/norms/late.py)
                norms, nu, late_sums = rec.finish(norms_sq, self.clip_factors)
                with exact_float32(x.device):
                    self.book_keeping(params, rec, stashes, nu, late_sums)
                return outputs, losses, norms
            self._lean = False
            set_rng_state(state, x.device)
            stashes.clear()
        # auto's Recorder (CUDA: faster than lean, more memory) may give way to the lean recorder on running out
        may_fall_back = (self.recorder == "auto" and self._lean and not self.traced
                         and not torch.compiler.is_compiling())
        state = rng_state(x.device) if may_fall_back else None
        try:
            return self.recorded(plan, params, model, loss_fn, x, y, stashes)
        except torch.OutOfMemoryError:
            if not may_fall_back:
                raise
            self._recorder_fits = False
        # out of the handler: the failed attempt's records, graph and sums went with recorded()'s frame (review 35:
        # held by this frame, they met the retry's lean step); p.grad is assigned only once every sum is formed
        stashes.clear()  # kept per-example gradients of the failed attempt
        log.warning("method=reweight: out of memory with Recorder (method.recorder=auto's choice on CUDA, the "
                    "faster); this step again and every later one with the lean recorder, which holds less "
                    "(method.recorder=lean from the start skips the attempt)")
        set_rng_state(state, x.device)
        return self.book_kept(plan, params, model, loss_fn, x, y)

    def recorded(self, plan, params, model, loss_fn, x, y, stashes: dict):
        """Book-keeping with Recorder: every call's output-gradient at the backward's end, then each layer's norm and
        clipped sum; p.grad assigned last (book_keeping). -> outputs, losses, norms."""
        with Recorder(plan) as rec, self.autocast(x):
            outputs = model(x)  # (B, classes)
            losses = loss_fn(outputs, y)  # (B,)
        rec.backprops(losses.sum(), retain_graph=False)  # every output-gradient at once: Recorder's peak
        # Memory (issue 12): one layer at a time. Its (a, g) (a conv's unfolded input) and any ghost Gram
        # matrices are freed before the next layer; only a per-example gradient small enough to keep
        # (norms/outer.py) waits for the clipped sums, which use the raw records and free each layer's as
        # soon as it is summed.
        with exact_float32(x.device):
            terms = []  # each layer's (B,) certified upper bounds, summed at the end
            for _, module, rule, a, g in rec.layers():
                terms.append(rule.norm_sq(module, a, g, self.how,
                                          stashes.setdefault(id(module), Stash(self.keep, id(module)))))
                del a, g
            norms = certified_norms(summed_terms(terms, losses.new_zeros(len(y)).detach()), len(terms))  # (B,)
            nu = self.clip_factors(norms)  # (B,); 0 for a record whose norm is not finite
            self.book_keeping(params, rec, stashes, nu)
        return outputs, losses, norms

    def recomputed(self, plan, params, model, loss_fn, x, y):
        """Norms from a graph-freeing backward, then a second forward (same random state) for the re-weighted one.
        A call the source-only backward could not reach (StreamingNorms.complete) makes it start again asking for
        every covered layer's parameters."""
        state = rng_state(x.device)
        for ask_all in (False, True):
            set_rng_state(state, x.device)
            with StreamingNorms(plan, self.how, remember="terms") as streaming:
                losses = loss_fn(model(x), y)  # (B,)
            if ask_all:
                norms_sq = streaming.backward_all(losses.sum(), len(y))
            else:
                norms_sq = streaming.backward(losses.sum(), len(y), keep_graph=False)
            del losses
            if streaming.complete:
                break
        norms = certified_norms(norms_sq, streaming.layers)  # (B,)
        nu = self.clip_factors(norms)  # (B,); 0 for a record whose norm is not finite
        set_rng_state(state, x.device)  # the second forward draws the dropout masks the norms were formed with
        # the same forward and backward again, each layer's clipped sum formed from the output-gradients as they
        # arrive (runner/norms/released.py); a record with nu = 0 has its rows masked there, and the chunk is formed
        # again without it (backward_holds_records, runner/methods/dropped.py)
        with ReleasedSums(plan, nu, streaming) as release:
            outputs = model(x)  # (B, classes)
            losses = loss_fn(outputs, y)  # (B,)
        self.assign(params, release.run(losses.sum(), len(y), graph_kept=False, ask_all=ask_all))
        return outputs, losses, norms, release.agrees()

    @staticmethod
    def assign(params, sums: dict) -> None:
        """p.grad = each parameter's clipped sum (zero for a covered module not called)."""
        for p in params:
            p.grad = sums.pop(id(p), None)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if sums:
            raise RuntimeError("reweight: a rule returned a gradient for a parameter that is not trainable")

    @staticmethod
    @torch.no_grad()
    def book_keeping(params, rec, stashes, nu, late_sums: dict | None = None):
        """Each layer's clipped sum from its recorded inputs and output-gradients; no second backward. Under no_grad:
        the conv rule calls the weight-gradient kernel with the layer's weight, and recorded history would keep the
        step's records alive in p.grad (and, over the chunks of a logical batch, every chunk's).

        A record whose norm is not finite has nu = 0 and must add exactly nothing (no 0 * inf): its rows are masked.
        The sums are first formed unmasked, as if every example were kept (the common case: no record copied); then
        the one read of the step asks whether every one was (every_record_kept), with all the sums already launched
        (asked before them, the host waited for the backward's kernels and then launched the sums on an idle GPU: 7%
        of ResNet-18's bk step on an H100, docs/bench.md "On an H100 (stop 41)"). On CUDA the value is sent to the
        host before the sums (certify.read_started), so the host waits for the norms' kernels, not for the sums',
        which the GPU runs while the host goes on. Only if one was not kept are the sums formed again, masked, from
        the same records. Unmasked and masked sums are equal when every example is kept (a row
        with nu = 0 and finite values adds zeros), so the released sum is always the masked one. The records are
        freed when the sums are final. Compiled: one masked pass, nothing read. late_sums: the late layers' clipped
        sums, final already (runner/norms/late.py)."""
        keep = nu > 0  # (B,)
        if torch.compiler.is_compiling():
            sums = ReweightGP.clipped_sums(rec, stashes, nu, keep, all_kept=False)
        else:
            started = certify.read_started(keep)  # CUDA: keep.all() on its way to the host, before the sums
            sums = ReweightGP.clipped_sums(rec, {k: dict(s) for k, s in stashes.items()}, nu, keep, all_kept=True)
            if not certify.every_record_kept(keep, started):  # the step's one read (tests count it there)
                sums = ReweightGP.clipped_sums(rec, stashes, nu, keep, all_kept=False)
        stashes.clear()
        for _, module, _ in rec.plan.layers:
            rec.release(module)
        sums.update(late_sums or {})
        ReweightGP.assign(params, sums)  # a covered module that was not called this step contributes zero

    @staticmethod
    def clipped_sums(rec, stashes, nu, keep, all_kept: bool) -> dict:
        """{id(parameter): its clipped sum} from every layer's records (the rules pop what they use from `stashes`),
        the rows of examples not kept masked unless all_kept (certify.clipped_sums_of)."""
        sums = {}
        with clipped_sums_of(nu, keep, all_kept):
            for _, module, rule, calls in rec.raw_layers():
                for name, s in rule.clipped_sums_calls(module, calls, nu, stashes.pop(id(module), None)).items():
                    sums[id(getattr(module, name))] = s
                del calls  # this layer's float32 upcasts (bf16 records), if any
        return sums

