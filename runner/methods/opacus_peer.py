"""Opacus as a peer (the JL paper's "DP-SGD-Outer"): Opacus 1.6 computes the per-example gradients or norms.

Opacus supplies only what it is being compared on, the per-example gradient machinery; clipping (factor
min(1, C/(norm+1e-6)), Opacus's own formula), noise (runner/methods/noise.py) and the optimizer step are the
same code every other method uses, so timings and results compare apples to apples.

    dprun method=opacus                                  # method.grad_sample_mode=hooks (the default)
    dprun method=opacus method.grad_sample_mode=ghost    # ghost clipping: norms only, then a second backward
    dprun method=opacus method.grad_sample_mode=functorch

Modes (opacus.grad_sample.prepare_module):
  hooks      GradSampleModule's per-layer grad samplers (functorch for layers without one): p.grad_sample (B, *p.shape)
  functorch  the same, with torch.func for every layer
  ghost      GradSampleModuleFastGradientClipping: per-layer norms (ghost norm where Opacus has a rule), then the
             clipped sum by a second backward of sum_i factor_i * loss_i (Opacus's DPTensorFastGradientClipping).
             Opacus rejects a layer called twice in one forward (recurrent cells) in this mode. dprun refuses a
             conv with padding_mode reflect/replicate/circular here: Opacus's norm assumes zero padding while the
             second backward releases the true gradient, so an example could exceed C (not_exact below).

attach() (its prepare hook) attaches Opacus's hooks to the model itself (prepare_module(..., wrap_model=False), the hook classes that
GradSampleModule is built on), so the returned module is the original: same forward, parameters and state_dict keys.
Needs the optional extra: pip install -e '.[peers]'.
"""
from __future__ import annotations

import inspect
import logging
import warnings

import torch

from runner.errors import DprunError
from runner.methods.base import METHODS, Method, Privatized, trainable
from runner.norms.certify import certified_norms, finite_rows, upper_sqnorm
from runner.methods.features import Feature

MODES = ("hooks", "ghost", "functorch")
log = logging.getLogger("dprun")


def import_opacus():
    """opacus.grad_sample.prepare_module, or a one-line DprunError naming the extra."""
    try:
        from opacus.grad_sample import prepare_module
    except ImportError as e:
        raise DprunError("method=opacus needs Opacus: pip install 'dprun[peers]' (or -e '.[peers]' in a checkout)") from e
    return prepare_module


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def not_exact(model: torch.nn.Module):
    """(path, module, issue) for each layer whose per-example gradient Opacus 1.6's own samplers get wrong (checked
    against nxbp in all three modes, tests/test_clip_contribution.py): a convolution that pads its input with
    padding_mode reflect/replicate/circular (its unfold pads with zeros), an Embedding with padding_idx (its grad
    and ghost-norm samplers give that row a gradient) or scale_grad_by_freq=True (they ignore it: the rows are not
    divided by the example's token counts; 0.07-0.18 C off nxbp's). One issue per layer (an Embedding with both:
    "padding_idx+scale_grad_by_freq"). Strides, dilation, groups, 'same'/'valid', Conv3d, ConvTranspose
    (torch.func), the norm layers and Linear are exact."""
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.modules.conv._ConvNd) and m.padding_mode != "zeros" \
                and any(m._reversed_padding_repeated_twice):
            yield path, m, "padding_mode"
        elif isinstance(m, torch.nn.Embedding) and (m.padding_idx is not None or m.scale_grad_by_freq):
            yield path, m, "+".join(k for k, on in (("padding_idx", m.padding_idx is not None),
                                                    ("scale_grad_by_freq", m.scale_grad_by_freq)) if on)


def required_inputs(m: torch.nn.Module) -> int:
    """How many positional arguments m.forward requires (no default); 1 where its signature cannot be read."""
    try:
        params = inspect.signature(m.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def cannot_sample(model: torch.nn.Module):
    """(path, module, what, why) for each layer Opacus 1.6 cannot give per-example gradients, whatever the mode: it
    crashed at attach or at the step with a raw torch error (refused at attach instead, prepare):
      torch's fused nn.RNN/LSTM/GRU: no grad sampler, and its torch.func fallback fails on them ("output with
        shape [1, 16] doesn't match the broadcast shape"), proj_size, bidirectional and dropout included;
      a trainable layer whose forward takes two or more inputs (nn.Bilinear, nn.MultiheadAttention): Opacus keeps
        only the first input (its torch.func fallback calls layer(activations[0]));
      the old torch.nn.utils.weight_norm (a forward pre-hook that writes layer.weight from weight_g and weight_v):
        grad_sample_mode=functorch cannot deepcopy the layer (its weight is no leaf), hooks's samplers see the
        written weight, not weight_g and weight_v."""
    from torch.nn.utils.weight_norm import WeightNorm

    for path, m in model.named_modules():
        path = path or "<model>"
        if isinstance(m, torch.nn.RNNBase):
            yield path, m, "a fused recurrent layer", (
                "Opacus 1.6 has no per-example gradient for torch's fused RNN/LSTM/GRU (its torch.func fallback "
                "fails on them); accepted: the project's unfused model=rnn/lstm/gru/bilstm "
                "(runner/models/recurrent.py), or method=nxbp or jl")
        elif any(isinstance(h, WeightNorm) for h in m._forward_pre_hooks.values()):
            yield path, m, "torch.nn.utils.weight_norm", (
                "the old weight_norm writes the weight from weight_g and weight_v in a forward pre-hook, which "
                "Opacus's per-layer gradients do not see (functorch cannot even copy the layer); accepted: "
                "torch.nn.utils.parametrizations.weight_norm (method=opacus, multiloss or nxbp)")
        elif any(p.requires_grad for p in m.parameters(recurse=False)) and required_inputs(m) > 1:
            yield path, m, f"a forward of {required_inputs(m)} inputs", (
                "Opacus 1.6 keeps only a layer's first input, so it cannot form this layer's per-example "
                "gradients; accepted: trainable layers called on one input, or method=nxbp or multiloss")


@METHODS.register("opacus")
class OpacusPeer(Method):
    name = "opacus"
    summary = "Opacus 1.6 per-sample gradients (hooks | functorch) or ghost norms; our clip and noise (DP-SGD-Outer)"
    # Opacus 1.6's unfold2d builds the patches with row-major strides whatever the input's: on channels-last
    # activations its per-example conv gradients are wrong (0.07-0.3 off on the zoo's CNNs, hooks and ghost alike;
    # tests/test_memory_format.py). prepare() puts the model's weights in NCHW, privatize() each batch
    channels_last = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode = self.choice("grad_sample_mode", "hooks", MODES)
        # ghost: Opacus's float32 Gram norms of sequence and conv layers are not certified (they cancel on crafted
        # inputs: 1.36 C measured, issue 26), so training refuses them; the bench sets this to time them anyway
        self.uncertified_ok = bool(self.option("uncertified_ok", False))
        self.hooks = None  # Opacus's hooks object, attached to the model by prepare()

    def prepare(self, model: torch.nn.Module, data=None) -> torch.nn.Module:
        prepare_module = import_opacus()
        for path, m, what, why in cannot_sample(model):  # raw torch errors at attach or at the step otherwise
            raise DprunError(f"method=opacus grad_sample_mode={self.mode} cannot train {path} ({type(m).__name__}, "
                             f"{what}): {why}")
        for path, m, issue in not_exact(model):  # before any hook moves: a refused model leaves the method as it was
            self.check_layer(path or "<model>", m, issue)
        if self.mode == "ghost" and not self.uncertified_ok:
            for path, m in model.named_modules():
                if any(p.requires_grad for p in m.parameters(recurse=False)):
                    self.refuse_uncertified(path or "<model>", m)
        if self.hooks is not None:
            self.hooks.cleanup()  # one model per method instance: detach from the previous one
        model.to(memory_format=torch.contiguous_format)  # NCHW activations (channels_last above), in place
        kwargs = {"max_grad_norm": self.clip, "use_ghost_clipping": True} if self.mode == "ghost" else {}
        # Opacus's own hooks on a model whose input needs no gradient, and its float64 autocast: expected, harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                "respect to module outputs since no inputs require gradients")
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
        try:
            self.hooks = prepare_module(model, self.mode, False, batch_first=True, loss_reduction="sum",
                                        strict=True, **kwargs)
        except (NotImplementedError, ValueError) as e:
            raise DprunError(f"method=opacus grad_sample_mode={self.mode}: Opacus rejects "
                             f"{type(model).__name__}: {first_line(e)}") from e
        return model

    def unsupported(self, feature: Feature) -> str | None:
        if feature is Feature.BF16 and self.mode == "ghost":
            return ("grad_sample_mode=ghost's second backward rounds differently from the pass that measured the "
                    "norms, so an example's contribution could exceed C; use grad_sample_mode=hooks or functorch")
        return None

    def refuse_uncertified(self, path: str, m: torch.nn.Module) -> None:
        """Opacus 1.6's ghost clipping bounds no example for training (issue 26, tests/test_certified_clipping.py):
        its float32 Gram norms cancel on crafted inputs (1.36 C measured on a Linear over 16 positions), its norm
        pass and its second backward round differently even without a Gram (LayerNorm 1.00003 C, GroupNorm
        1.00008 C), and a record with inf inputs turns the release into nan (0 * inf in the second backward)."""
        raise DprunError(f"method=opacus grad_sample_mode=ghost cannot train {path} ({type(m).__name__}): Opacus's "
                         f"ghost clipping is not certified (its float32 norms can under-estimate what its second "
                         f"backward releases: unbounded, up to 135 C found by the search, nan beside an inf "
                         f"record); grad_sample_mode=hooks and functorch are exact, and method=reweight certifies "
                         f"its ghost norms")

    def check_layer(self, path: str, m: torch.nn.Module, issue: str) -> None:
        """A layer Opacus 1.6 gets wrong (not_exact): refused where an example could exceed C, else one warning.

        functorch differentiates the layer's own forward: exact, nothing to say. hooks: the per-example gradients
        are wrong but each is clipped before the sum, so every contribution is <= C. ghost: the norm is Opacus's
        but the released gradient is the TRUE one (the second backward), so only a norm that never under-estimates
        keeps the bound: the padding_idx row (Opacus counts a gradient the true one lacks: an over-estimate) does,
        a zero-padded unfold of a reflect/replicate/circular-padded input does not (measured: 1.13 C), and
        scale_grad_by_freq does not either: the second backward is the whole batch's, which divides each token's
        row by its count in the batch, so an example's contribution moves with the others' tokens (as method=jl's,
        runner/methods/privacy_check/modules.py)."""
        if self.mode == "functorch":
            return
        kind = type(m).__name__
        if "scale_grad_by_freq" in issue and self.mode == "ghost":
            raise DprunError(f"method=opacus grad_sample_mode=ghost cannot clip {path} ({kind}, scale_grad_by_freq="
                             f"True): its second backward is the whole batch's, which divides each token's row by its "
                             f"count in the batch, so an example's contribution moves with the other examples' "
                             f"tokens; accepted: scale_grad_by_freq=False, or method.grad_sample_mode=functorch "
                             f"(exact) or hooks, or method=nxbp or multiloss")
        if issue == "padding_mode" and self.mode == "ghost":
            raise DprunError(f"method=opacus grad_sample_mode=ghost cannot clip {path} ({kind}, padding_mode="
                             f"{m.padding_mode!r}): Opacus 1.6's ghost norm assumes zero padding but the released "
                             f"gradient is the true one, so an example could exceed the clip bound; accepted: "
                             f"padding_mode='zeros' (or padding=0); use method.grad_sample_mode=functorch (exact) or "
                             f"hooks, or method=reweight")
        if issue == "padding_mode":
            what, wrong = f"padding_mode={m.padding_mode!r}", "grad sampler pads with zeros"
        else:
            sampler = "ghost norm" if self.mode == "ghost" else "grad sampler"
            settings = {"padding_idx": (f"padding_idx={m.padding_idx}", "gives the padding row a gradient"),
                        "scale_grad_by_freq": ("scale_grad_by_freq=True", "ignores scale_grad_by_freq (the rows are "
                                                                          "not divided by the example's token "
                                                                          "counts)")}
            parts = [settings[k] for k in issue.split("+")]
            what = ", ".join(w for w, _ in parts)
            wrong = f"{sampler} " + " and ".join(x for _, x in parts)
        effect = ("its norms over-estimate the released (true) gradient's and examples are clipped harder than "
                  "nxbp's" if self.mode == "ghost" else "its per-example gradients differ from nxbp's, each clipped "
                  "before the sum")
        log.warning("method=opacus grad_sample_mode=%s: %s (%s, %s): Opacus 1.6's %s, so %s; every contribution is "
                    "<= C: privacy holds (grad_sample_mode=functorch is exact)", self.mode, path, kind, what, wrong,
                    effect)

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        if self.hooks is None or self.hooks._module is not model:
            raise DprunError("method=opacus: call method.attach(model) before privatize (it attaches Opacus's hooks)")
        if not model.training:
            raise DprunError("method=opacus: Opacus captures activations only in train mode; call model.train() first")
        params = trainable(model)
        x = x.contiguous() if torch.is_tensor(x) else x  # a channels-last batch would make channels-last activations
        self.hooks.set_grad_sample_to_none()
        for p in params:
            p.__dict__.pop("_norm_sample", None)  # no stale norms from the previous step
        try:
            if self.mode == "ghost":
                outputs, losses, norms = self.ghost(model, params, loss_fn, x, y)
            else:
                outputs, losses, norms = self.grad_samples(model, params, loss_fn, x, y)
        except (NotImplementedError, ValueError, AttributeError) as e:
            for m in model.modules():  # drop activations Opacus captured before failing
                m.__dict__.pop("activations", None)
            raise DprunError(f"method=opacus grad_sample_mode={self.mode} fails on {type(model).__name__}: "
                             f"{first_line(e)}") from e
        return Privatized(losses.detach(), outputs.detach(), norms.detach())

    def grad_samples(self, model, params, loss_fn, x, y):
        """hooks / functorch: p.grad_sample (B, *p.shape) -> norms -> clipped sum (Opacus's clip_and_accumulate)."""
        with self.autocast(x):
            outputs = model(x)
            losses = loss_fn(outputs, y)  # (B,)
        # Opacus's hooks fill p.grad_sample; p.grad gets the unclipped sum (overwritten). inputs=params: a leaf
        # outside the model (a learnable temperature in loss_fn) gets no raw, unclipped gradient in its .grad
        losses.sum().backward(inputs=params)
        samples = []
        for p in params:
            if not torch.is_tensor(p.grad_sample):  # None: unused parameter; list: an un-cleared earlier backward
                raise AttributeError(f"Opacus computed no grad_sample for a parameter of shape {tuple(p.shape)}")
            samples.append(p.grad_sample.to(p.dtype))  # (B, *p.shape); bf16: norms and sum from the same upcast
        norms = certified_norms(sum(upper_sqnorm(g) for g in samples), len(samples))  # (B,) certified (norms/certify.py)
        factor = self.clip_factors(norms)  # (B,); 0 for a non-finite gradient, whose rows are zeroed
        for p, g in zip(params, samples):
            p.grad = torch.einsum("i,i...", factor.to(g.dtype), finite_rows(g, factor > 0))  # sum_i f_i g_i
        self.hooks.set_grad_sample_to_none()
        return outputs, losses, norms

    def ghost(self, model, params, loss_fn, x, y):
        """ghost: backward 1 with Opacus's norm hooks -> norms; backward 2 of sum_i f_i loss_i, hooks off."""
        self.hooks.enable_hooks()
        outputs = model(x)
        losses = loss_fn(outputs, y)  # (B,)
        losses.sum().backward(retain_graph=True, inputs=params)  # inputs: as in grad_samples
        norms = self.hooks.get_norm_sample()  # (B,) from each parameter's p._norm_sample
        factor = self.clip_factors(norms)  # (B,)
        for p in params:
            p.grad = None
        self.hooks.disable_hooks()
        try:
            (factor.detach().to(losses.dtype) * losses).sum().backward(inputs=params)
        finally:
            self.hooks.enable_hooks()
        return outputs, losses, norms

