"""torch's float32 math-mode flags, read and set so that nothing a user set beforehand can make them lie or raise.

float32 matmuls and convolutions may run with reduced-precision products when a global flag allows it: TF32 on CUDA
(cuBLAS, cuDNN), bf16 or TF32 through oneDNN on the CPU (`torch.set_float32_matmul_precision("medium")` sets
oneDNN's matmul to bf16; oneDNN is then free to round the inputs to bf16). The certified norms
(runner/norms/certify.py) assume float32's 24-bit products, so a step forces them where its precision asks for
float32 (runner/precision.py matmul_precision, certify.exact_float32), and puts the user's flags back after.

torch >= 2.9 keeps each flag twice: a "legacy" one (allow_tf32, set_float32_matmul_precision) and per-(backend, op)
strings (torch.backends.cuda.matmul.fp32_precision, ...; "none" inherits from the backend, then from the generic
one). A user (or a library: transformers' enable_tf32) who set only the new strings leaves the legacy flags out of
step, and reading a legacy flag then raises ("mix of the legacy and new APIs"). So this module reads the new strings
(never raising) and sets both where the legacy flags are readable: the legacy setter first (it writes both,
consistently), then the leaves explicitly, so a generic "tf32" is not inherited where we asked for "ieee".

    with float32_mode("cuda", tf32=False):   # cuBLAS and cuDNN (conv, rnn) products in float32 inside
        ...
    with float32_mode("cpu"):                # oneDNN (matmul, conv, rnn) products in float32 inside
        ...
    tf32_enabled()                           # True if cuBLAS or cuDNN would take TF32 products now
    with tf32_paused():                      # TF32 off (cheaply inside a float32_mode("cuda", tf32=True))
        ...
"""
from __future__ import annotations

import contextlib

import torch

_NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")  # torch >= 2.9
OPS = ("matmul", "conv", "rnn")
LEAVES = {"cuda": tuple(("cuda", op) for op in OPS), "cpu": tuple(("mkldnn", op) for op in OPS)}


def effective(backend: str, op: str) -> str:
    """The precision torch applies to float32 `op` on `backend` ("ieee", "tf32", "bf16"): the leaf's string, else
    its backend's, else the generic one's (at::Context::float32Precision); "ieee" where all say "none"."""
    for b, o in ((backend, op), (backend, "all"), ("generic", "all")):
        value = torch._C._get_fp32_precision_getter(b, o)
        if value != "none":
            return value
    return "ieee"


_IEEE = ("none", "ieee")


def cpu_is_ieee() -> bool:
    """Does oneDNN take float32 products as they are (matmul, conv, rnn)? Five reads (~1.5 us): the common case,
    where float32_mode("cpu") has nothing to do. torch < 2.9: its matmul precision is "highest"."""
    if not _NEW_API:
        return torch.get_float32_matmul_precision() == "highest"
    get = torch._C._get_fp32_precision_getter
    return (get("generic", "all") in _IEEE and get("mkldnn", "all") in _IEEE and get("mkldnn", "matmul") in _IEEE
            and get("mkldnn", "conv") in _IEEE and get("mkldnn", "rnn") in _IEEE)


def tf32_enabled() -> bool:
    """Would a float32 cuBLAS matmul or cuDNN convolution/RNN take TF32 products now? Never raises."""
    if not _NEW_API:
        return torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    return any(effective(b, op) == "tf32" for b, op in LEAVES["cuda"])


# whether the innermost float32_mode set CUDA's TF32 on with every flag consistent (legacy and new, explicit leaves):
# then tf32_paused() turns it off and back with 4 setters (exact_float32, around each layer's norms and sums)
_STEP_TF32: list[bool] = []


class _Tf32Pause:
    """TF32 off inside, back to float32_mode(cuda, tf32=True)'s own state after: the legacy setters write the legacy
    flag and the leaf together (cuBLAS: matmul "ieee"/"tf32"; cuDNN: conv and rnn "none"/"tf32"), and conv/rnn get an
    explicit "ieee" inside so that a generic "tf32" is not inherited. ~2 us against ~10 us for a full float32_mode.
    Each exit puts back the four flags its entry found (~0.5 us to read them): nested in itself, or around a
    float32_mode inside it, no exit turns TF32 on where an outer pause has it off (review 34: an inner pause's exit
    turned it on inside the outer pause)."""

    def __init__(self):
        self.found: list[tuple] = []  # per entry: (cuBLAS, cuDNN, conv leaf, rnn leaf) as they were

    def __enter__(self):
        get = torch._C._get_fp32_precision_getter
        self.found.append((torch._C._get_cublas_allow_tf32(), torch._C._get_cudnn_allow_tf32(),
                           get("cuda", "conv"), get("cuda", "rnn")))
        torch._C._set_cublas_allow_tf32(False)
        torch._C._set_cudnn_allow_tf32(False)
        torch._C._set_fp32_precision_setter("cuda", "conv", "ieee")
        torch._C._set_fp32_precision_setter("cuda", "rnn", "ieee")

    def __exit__(self, *exc):
        cublas, cudnn, conv, rnn = self.found.pop()
        torch._C._set_cublas_allow_tf32(cublas)  # the legacy setters first (each writes its leaves), then the leaves
        torch._C._set_cudnn_allow_tf32(cudnn)
        torch._C._set_fp32_precision_setter("cuda", "conv", conv)
        torch._C._set_fp32_precision_setter("cuda", "rnn", rnn)


_PAUSE = _Tf32Pause()


def tf32_paused():
    """A context with TF32 off on CUDA: the cheap pause inside a step that float32_mode set to TF32, else a full
    float32_mode("cuda", tf32=False)."""
    return _PAUSE if _STEP_TF32 and _STEP_TF32[-1] else float32_mode("cuda", tf32=False)


def _try(read):
    try:
        return read()
    except RuntimeError:  # torch's legacy/new consistency check: the user's flags are already out of step
        return None


@contextlib.contextmanager
def float32_mode(device_type: str, tf32: bool = False):
    """Inside: float32 products on `device_type` ("cuda": TF32 on or off as asked; "cpu": oneDNN's IEEE float32,
    `tf32` ignored). Outside: every flag as it was, exactly. Other device types: unchanged."""
    if device_type not in LEAVES:
        yield
        return
    if not _NEW_API:  # torch < 2.9: the legacy flags only
        with _legacy_mode(device_type, tf32):
            yield
        return
    if device_type == "cpu" and cpu_is_ieee():
        yield  # nobody asked oneDNN for bf16/tf32: nothing to set
        return
    depth = len(_STEP_TF32)
    leaves = LEAVES["cuda"] + LEAVES["cpu"]  # all that the setters below may write
    saved_leaves = [torch._C._get_fp32_precision_getter(b, op) for b, op in leaves]
    cuda = device_type == "cuda"
    # the legacy flags, where readable; unreadable (the user's new strings left them out of step, and torch's kernels
    # then read the strings): left alone, as the user had them
    saved_matmul = _try(torch.get_float32_matmul_precision) if cuda else None
    saved_cudnn = _try(lambda: torch.backends.cudnn.allow_tf32) if cuda else None
    want = "tf32" if tf32 and cuda else "ieee"
    try:
        if saved_matmul is not None:  # the legacy setters write both APIs, consistently
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if saved_cudnn is not None:
            torch.backends.cudnn.allow_tf32 = tf32
        for b, op in LEAVES[device_type]:  # explicit, so a generic "tf32" or "bf16" is not inherited
            torch._C._set_fp32_precision_setter(b, op, want)
        if cuda:  # oneDNN's matmul "ieee" too: its "bf16" or "tf32" beside the legacy flag just set would make
            # torch's own get_float32_matmul_precision() raise inside (Inductor reads it)
            torch._C._set_fp32_precision_setter("mkldnn", "matmul", "ieee")
        _STEP_TF32.append(cuda and tf32 and saved_matmul is not None and saved_cudnn is not None)
        yield
    finally:
        if len(_STEP_TF32) > depth:
            _STEP_TF32.pop()
        if saved_matmul is not None:
            torch.set_float32_matmul_precision(saved_matmul)
        if saved_cudnn is not None:
            torch.backends.cudnn.allow_tf32 = saved_cudnn
        for (b, op), value in zip(leaves, saved_leaves):
            torch._C._set_fp32_precision_setter(b, op, value)


@contextlib.contextmanager
def _legacy_mode(device_type: str, tf32: bool):
    """torch < 2.9: cuBLAS/cuDNN's allow_tf32; on the CPU the matmul precision ("medium" let oneDNN take bf16)."""
    if device_type == "cpu":
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(saved)
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
