"""The model zoo: exact paper parameter counts, unfused layers equal PyTorch's fused ones, every model trains."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from runner import models
from runner.data.base import DataInfo
from runner.errors import DprunError
from runner.models import attention
from runner.models.attention import SelfAttention, composite_attention, fused_attention, softmax_attention
from runner.models.bu_cnn import TFSamePad2d
from runner.models.recurrent import GRULayer, LSTMLayer, RNNLayer
from runner.models.transformer import EncoderLayer

CONF_MODELS = Path(__file__).resolve().parent.parent / "conf" / "model"

MNIST = DataInfo("mnist", (1, 28, 28), 10)
CIFAR = DataInfo("cifar10", (3, 32, 32), 10)
DIGITS = DataInfo("digits", (1, 8, 8), 10)
IMDB = DataInfo("imdb", (150,), 2, "text", 8185)
LSUN64 = DataInfo("lsun", (3, 64, 64), 10)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, info, expected", [
    ("bu_cnn", MNIST, 26_010),                # JL paper Table 4
    ("papernot_cnn", CIFAR, 623_146),         # JL paper Table 2
    ("papernot_cnn_fc", CIFAR, 550_570),      # Papernot et al. 2020
    ("bilstm", IMDB, 598_274),                # JL paper Table 3
    ("mlp", MNIST, 136_074),                  # Lee & Kifer
    ("cnn", MNIST, 129_388),
    ("cnn", CIFAR, 187_988),
    ("cnn", DIGITS, 52_588),                  # padding=2 on 8x8
    ("rnn", MNIST, 21_514),
    ("lstm", MNIST, 82_186),
    ("gru", MNIST, 61_962),
    ("transformer", IMDB, 2_120_002),
    ("vgg11", CIFAR, 28_149_514),
    ("vgg13", CIFAR, 28_334_410),
    ("vgg16", CIFAR, 33_646_666),
    ("resnet18", CIFAR, 11_173_962),
    ("resnet18", LSUN64, 11_181_642),         # = torchvision resnet18(num_classes=10)
    ("resnet34", LSUN64, 21_289_802),
    ("resnet50", LSUN64, 23_528_522),         # = torchvision resnet50(num_classes=10)
    ("resnet101", LSUN64, 42_520_650),
])
def test_parameter_counts(name, info, expected):
    assert count(models.build(name, info)) == expected


def test_conf_files_and_registry_agree():
    conf = {p.stem for p in CONF_MODELS.glob("*.yaml")}
    assert "auto" in conf and "auto" not in models.MODELS  # auto = dataset.paper_model, not a model
    assert conf - {"auto"} == set(models.MODELS.names())


@pytest.mark.parametrize("path", sorted(CONF_MODELS.glob("*.yaml")), ids=lambda p: p.stem)
def test_conf_knobs_are_accepted(path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path))
    if path.stem == "auto":
        return
    cfg = {k: v for k, v in cfg.items() if not (isinstance(v, str) and "${" in v)}  # a dataset-dependent default
    info = IMDB if path.stem in ("bilstm", "transformer") else CIFAR
    assert cfg.pop("name") == path.stem
    assert count(models.build(path.stem, info, **cfg)) == count(models.build(path.stem, info))  # yaml = defaults


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(DprunError, match="unknown option model.depht.*valid: depth"):
        models.build("mlp", MNIST, depht=3)
    with pytest.raises(DprunError, match="needs images.*imdb"):
        models.build("cnn", IMDB)
    with pytest.raises(DprunError, match="at least 32x32"):
        models.build("vgg11", MNIST)
    with pytest.raises(DprunError, match="stem 'x'; valid: auto, cifar, imagenet"):
        models.build("resnet18", CIFAR, stem="x")
    with pytest.raises(DprunError, match="norm_groups=24 .*valid: 1, 2, 4, 8, 16, 32, 64"):
        models.build("vgg13", CIFAR, norm_groups=24)
    with pytest.raises(DprunError, match="unknown model 'cnnn'"):
        models.build("cnnn", CIFAR)


# ---- unfused recurrent layers equal torch.nn.RNN / LSTM / GRU -------------------------------------------------

def copy_torch_weights(ours, ref: nn.RNNBase):
    """Our x_proj/h_proj per direction <- torch's weight_ih/hh_l0[_reverse] and bias_ih/hh_l0[_reverse]."""
    for suffix in ([""] + (["_reverse"] if ref.bidirectional else [])):
        x_proj, h_proj = getattr(ours, "x_proj" + suffix), getattr(ours, "h_proj" + suffix)
        x_proj.weight.data.copy_(getattr(ref, f"weight_ih_l0{suffix}"))
        x_proj.bias.data.copy_(getattr(ref, f"bias_ih_l0{suffix}"))
        h_proj.weight.data.copy_(getattr(ref, f"weight_hh_l0{suffix}"))
        h_proj.bias.data.copy_(getattr(ref, f"bias_hh_l0{suffix}"))


@pytest.mark.parametrize("ours_cls, ref_cls", [(RNNLayer, nn.RNN), (LSTMLayer, nn.LSTM), (GRULayer, nn.GRU)])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_recurrent_layers_equal_torch(ours_cls, ref_cls, bidirectional):
    torch.manual_seed(0)
    ref = ref_cls(5, 7, batch_first=True, bidirectional=bidirectional).double()
    ours = ours_cls(5, 7, bidirectional=bidirectional, return_sequences=True).double()
    copy_torch_weights(ours, ref)
    x = torch.randn(3, 6, 5, dtype=torch.float64)
    seq, h_n = ref(x)
    h_n = h_n[0] if isinstance(h_n, tuple) else h_n  # LSTM: (h_n, c_n)
    torch.testing.assert_close(ours(x), seq, atol=1e-6, rtol=0)
    ours.return_sequences = False
    torch.testing.assert_close(ours(x), torch.cat(list(h_n), -1), atol=1e-6, rtol=0)  # (B, dirs*h)


def test_h_proj_is_called_once_per_step_and_keras_single_bias():
    layer = LSTMLayer(4, 3, double_bias=False)
    assert layer.h_proj.bias is None and layer.x_proj.bias is not None
    calls = []
    layer.h_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    layer.x_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    layer(torch.randn(2, 5, 4))
    assert calls == [(2, 5, 4)] + [(2, 3)] * 5  # x_proj once on (B, T, in), h_proj T times on (B, h)


# ---- attention and the encoder block equal torch.nn.MultiheadAttention / TransformerEncoderLayer -----------

def copy_attention_weights(ours: SelfAttention, ref: nn.MultiheadAttention):
    for lin, w, b in zip((ours.q, ours.k, ours.v), ref.in_proj_weight.chunk(3), ref.in_proj_bias.chunk(3)):
        lin.weight.data.copy_(w)
        lin.bias.data.copy_(b)
    ours.out.weight.data.copy_(ref.out_proj.weight)
    ours.out.bias.data.copy_(ref.out_proj.bias)


def test_attention_equals_torch_multihead_attention():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).double()
    ours = SelfAttention(16, 4).double()
    copy_attention_weights(ours, ref)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    pad = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    expected, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(ours(x, pad), expected, atol=1e-10, rtol=0)


def _qkv_and_padding(dtype=torch.float64):
    torch.manual_seed(1)
    q, k, v = (torch.randn(3, 2, 5, 4, dtype=dtype, requires_grad=True) for _ in range(3))  # (B, H, T, d_h)
    pad = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)  # (B, T)
    return q, k, v, pad


def test_the_fused_attention_equals_the_written_out_softmax_with_its_gradients():
    """SelfAttention without dropout runs F.scaled_dot_product_attention; with dropout the written-out softmax.
    Same values and gradients (float64), padding keys masked."""
    q, k, v, pad = _qkv_and_padding()
    fused = fused_attention(q, k, v, pad)
    written = softmax_attention(q, k, v, pad)
    torch.testing.assert_close(fused, written, atol=1e-12, rtol=0)
    u = torch.randn_like(fused)
    g_fused = torch.autograd.grad(fused, (q, k, v), u)
    g_written = torch.autograd.grad(written, (q, k, v), u)
    for a, b in zip(g_fused, g_written):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_the_attention_path_follows_dropout_and_mode(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "fused_attention", lambda *a: calls.append("fused") or softmax_attention(*a[:4]))
    monkeypatch.setattr(attention, "softmax_attention",
                        lambda *a: calls.append("softmax") or softmax_attention(*a[:4]))
    x = torch.randn(2, 5, 16)
    SelfAttention(16, 4, dropout=0.0).train()(x)
    SelfAttention(16, 4, dropout=0.1).eval()(x)
    SelfAttention(16, 4, dropout=0.1).train()(x)
    assert calls == ["fused", "fused", "softmax"]


def test_composite_attention_gives_forward_mode_double_backward_and_vmap():
    """SDPA's fused CPU kernel has none of them; jl (jvp, double_vjp) and multiloss (vmap) run under
    composite_attention() and get the written-out softmax's derivatives."""
    q, k, v, pad = _qkv_and_padding()
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    with composite_attention():
        _, jvp_fused = torch.func.jvp(lambda *t: fused_attention(*t, pad), (q, k, v), tangents)
        (g,) = torch.autograd.grad(fused_attention(q, k, v, pad).pow(2).sum(), q, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), k)
        per_example = torch.func.vmap(torch.func.grad(lambda a, b, c, m: fused_attention(
            a[None], b[None], c[None], m[None]).pow(2).sum()))(q, k, v, pad)
    _, jvp_written = torch.func.jvp(lambda *t: softmax_attention(*t, pad), (q, k, v), tangents)
    torch.testing.assert_close(jvp_fused, jvp_written, atol=1e-12, rtol=0)
    (g2,) = torch.autograd.grad(softmax_attention(q, k, v, pad).pow(2).sum(), q, create_graph=True)
    torch.testing.assert_close(gg, torch.autograd.grad(g2.sum(), k)[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(per_example, torch.autograd.grad(softmax_attention(q, k, v, pad).pow(2).sum(), q)[0],
                               atol=1e-12, rtol=0)


def test_the_fused_attention_under_bf16_autocast_and_vmap():
    """Under autocast, q, k, v arrive in bf16 (the Linears' outputs); vmap (multiloss) of SDPA's math backend with
    autocast on fails in torch 2.13, so fused_attention turns autocast off around it."""
    q, k, v, pad = _qkv_and_padding(torch.float32)
    W = torch.randn(4, 4)

    def loss(w, a, b, c, m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused_attention(a[None] @ w, b[None] @ w, c[None] @ w, m[None])
        assert out.dtype == torch.bfloat16
        return out.float().pow(2).sum()

    with composite_attention():
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0, 0))(W, q.detach(), k.detach(),
                                                                                   v.detach(), pad)
    assert grads.shape == (3, 4, 4) and bool(torch.isfinite(grads).all())


def test_encoder_layer_equals_torch_transformer_encoder_layer():
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).double().eval()
    ours = EncoderLayer(16, 4, 32, dropout=0.0).double()
    copy_attention_weights(ours.attn, ref.self_attn)
    for name in ("linear1", "linear2", "norm1", "norm2"):
        getattr(ours, name).load_state_dict(getattr(ref, name).state_dict())
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    pad = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():  # the reference's fast path needs no_grad; it returns zeros at padded positions
        expected = ref(x, src_key_padding_mask=pad)
        got = ours(x, pad)
    keep = ~pad
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-10, rtol=0)


def test_only_explicit_modules_carry_recurrent_and_attention_parameters():
    allowed = (nn.Linear, nn.Embedding, nn.LayerNorm)
    for name, info in (("bilstm", IMDB), ("lstm", MNIST), ("gru", MNIST), ("rnn", MNIST), ("transformer", IMDB)):
        model = models.build(name, info)
        for module in model.modules():
            if list(module.parameters(recurse=False)):
                assert isinstance(module, allowed), f"{name}: {type(module).__name__} holds raw parameters"


# ---- TF 'same' padding -------------------------------------------------------------------------------------

def test_tf_same_padding_is_asymmetric_like_tensorflow():
    pad = TFSamePad2d(8, 2)
    assert pad.amounts(28) == (3, 3)  # MNIST: out 14, total 6
    assert pad.amounts(27) == (3, 4)  # TF puts the odd pixel after
    assert pad(torch.zeros(1, 1, 27, 27)).shape[-2:] == (34, 34)
    assert TFSamePad2d(4, 2).amounts(5) == (1, 2) and TFSamePad2d(1, 2).amounts(5) == (0, 0)


# ---- every model: no BatchNorm, and a few SGD steps on matching synthetic data -----------------------------

def small_info(name: str) -> DataInfo:
    if name in ("bilstm", "transformer"):
        return DataInfo("text", (12,), 2, "text", 50)
    if name.startswith(("vgg", "resnet", "papernot")):
        return DataInfo("image", (3, 32, 32), 10)
    return DataInfo("image", (1, 28, 28), 10)


def synthetic_batch(info: DataInfo, batch: int):
    g = torch.Generator().manual_seed(0)
    if info.kind == "text":
        x = torch.randint(1, info.vocab_size, (batch, *info.input_shape), generator=g)
        x[0, 8:] = 0  # some padding
    else:
        x = torch.randn(batch, *info.input_shape, generator=g)
    return x, torch.randint(0, info.num_classes, (batch,), generator=g)


@pytest.mark.parametrize("name", models.MODELS.names())
def test_every_model_trains_without_batchnorm(name):
    torch.manual_seed(0)
    info = small_info(name)
    # ResNets train with the cheap 7x7/2 stem here (CPU time); the 32x32 stem runs in test_images_as_rows...
    model = models.build(name, info, **({"stem": "imagenet"} if name.startswith("resnet") else {}))
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    x, y = synthetic_batch(info, 2 if name.startswith(("vgg", "resnet")) else 4)
    if name == "resnet101":  # a forward pass only: keeps the file fast (counts are tested above)
        with torch.no_grad():
            assert model(x).shape == (2, 10)
        return
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        assert math.isfinite(loss.item())
        loss.backward()
        opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_text_models_ignore_an_all_padding_sequence_gracefully():
    info = DataInfo("text", (6,), 2, "text", 20)
    x = torch.tensor([[0, 0, 0, 0, 0, 0], [3, 4, 5, 0, 0, 0]])
    for name in ("transformer", "bilstm"):
        assert torch.isfinite(models.build(name, info).eval()(x)).all()


def test_transformer_pools_only_real_tokens():
    info = DataInfo("text", (6,), 2, "text", 20)
    model = models.build("transformer", info, dropout=0.0).eval()
    x = torch.tensor([[3, 4, 5, 0, 0, 0]])
    # padding is masked as a key and left out of the mean, so more padding changes nothing
    longer = models.build("transformer", DataInfo("text", (9,), 2, "text", 20), dropout=0.0).eval()
    longer.load_state_dict(model.state_dict())
    torch.testing.assert_close(longer(torch.tensor([[3, 4, 5, 0, 0, 0, 0, 0, 0]])), model(x), atol=1e-6, rtol=0)


def test_transformer_layers_stack_encoder_blocks():
    """layers=k: k blocks in sequence, each the paper's block (the GPT-2-small-shaped bench: layers=12)."""
    info = DataInfo("text", (6,), 2, "text", 20)
    torch.manual_seed(0)
    deep = models.build("transformer", info, d_model=8, heads=2, ff=16, dropout=0.0, layers=3).eval()
    one = count(models.build("transformer", info, d_model=8, heads=2, ff=16))
    block = count(deep.encoder[0])
    assert len(deep.encoder) == 3 and count(deep) == one + 2 * block
    x = torch.tensor([[3, 4, 5, 0, 0, 0]])
    h, pad = deep.positions(deep.embed(x)), x == 0
    for b in deep.encoder:
        h = b(h, pad)
    keep = (~pad).unsqueeze(-1).float()
    torch.testing.assert_close(deep(x), deep.head((h * keep).sum(1) / keep.sum(1)))
    with pytest.raises(DprunError, match=r"^model.layers=0 must be an integer >= 1"):
        models.build("transformer", info, layers=0)


def test_images_as_rows_and_larger_inputs():
    with torch.no_grad():  # 32x32: the cifar stem, no max-pool
        assert models.build("resnet18", CIFAR)(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    assert models.build("lstm", CIFAR)(torch.randn(2, 3, 32, 32)).shape == (2, 10)  # rows of 3*32 values
    assert models.build("transformer", MNIST, dropout=0.0)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with torch.no_grad():
        assert models.build("vgg11", LSUN64, fc_width=0)(torch.randn(1, 3, 64, 64)).shape == (1, 10)


def test_glove_initialises_known_tokens(tmp_path):
    glove = tmp_path / "glove.txt"
    glove.write_text("the 1 2 3 4\nmovie 5 6 7 8\n")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\nThe\n##movie\nzzz\n")
    info = DataInfo("text", (5,), 2, "text", 6)
    model = models.build("transformer", info, d_model=4, heads=2, glove_path=str(glove), vocab_path=str(vocab),
                         freeze_embedding=True)
    w = model.embed.weight
    assert torch.equal(w[0], torch.zeros(4)) and torch.equal(w[1], torch.tensor([1.0, 2, 3, 4]))
    assert torch.equal(w[2], torch.tensor([5.0, 6, 7, 8])) and not w.requires_grad
    with pytest.raises(DprunError, match="vocab_path"):
        models.build("transformer", info, d_model=4, heads=2, glove_path=str(glove))
    with pytest.raises(DprunError, match="3 dimensions"):
        glove.write_text("the 1 2 3\n")
        models.build("transformer", info, d_model=4, heads=2, glove_path=str(glove), vocab_path=str(vocab))


# ---- recurrent layers: padding mask, Keras initialisation, backward cost -----------------------------------

def test_masked_bilstm_reads_each_review_as_if_it_had_no_padding():
    """mask_padding=true: an end-padded review gives exactly the output of the same review without its padding
    (each direction's state is held through the pad steps), for every example of a ragged batch."""
    info = DataInfo("text", (7,), 2, "text", 20)
    torch.manual_seed(0)
    model = models.build("bilstm", info, hidden=4, embed_dim=3, dense=4, mask_padding=True).double()
    lengths = [7, 3, 1, 5]
    x = torch.zeros(len(lengths), 7, dtype=torch.long)
    for i, n in enumerate(lengths):
        x[i, :n] = torch.randint(1, 20, (n,))
    out = model(x)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out[i], model(x[i:i + 1, :n])[0], rtol=0, atol=1e-12)
    unmasked = models.build("bilstm", info, hidden=4, embed_dim=3, dense=4).double()
    unmasked.load_state_dict(model.state_dict())
    assert not torch.allclose(unmasked(x)[1], out[1])  # without the mask the pad steps change the state


def test_mask_padding_needs_text():
    with pytest.raises(ValueError, match="mask_padding=true needs a text dataset"):
        models.build("lstm", MNIST, mask_padding=True)


def test_bilstm_defaults_to_keras_initialisers_and_torch_init_is_kept_on_request():
    torch.manual_seed(0)
    keras = models.build("bilstm", IMDB)
    rec = keras.recurrent
    h = rec.hidden_size
    assert keras.embed.weight.abs().max() <= 0.05
    for x_proj, h_proj in ((rec.x_proj, rec.h_proj), (rec.x_proj_reverse, rec.h_proj_reverse)):
        assert torch.equal(x_proj.bias[h:2 * h], torch.ones(h))  # forget gate
        assert torch.count_nonzero(x_proj.bias[:h]) == 0 and torch.count_nonzero(x_proj.bias[2 * h:]) == 0
        w = h_proj.weight.detach()  # (4h, h): orthonormal columns
        torch.testing.assert_close(w.T @ w, torch.eye(h), atol=1e-5, rtol=0)
        bound = (6 / (x_proj.in_features + x_proj.out_features)) ** 0.5
        assert x_proj.weight.abs().max() <= bound
    for layer in keras.head:
        if isinstance(layer, nn.Linear):
            assert torch.count_nonzero(layer.bias) == 0
    torch_init = models.build("bilstm", IMDB, init="torch").recurrent
    assert torch.count_nonzero(torch_init.x_proj.bias) > h  # PyTorch's U(-1/sqrt(h), 1/sqrt(h)) everywhere
    assert models.build("lstm", MNIST).recurrent.x_proj.bias.abs().max() <= 128 ** -0.5 + 1e-7
    with pytest.raises(ValueError, match="model.init='glorot' is not one of torch, keras"):
        models.build("bilstm", IMDB, init="glorot")


def test_recurrent_backward_has_no_per_step_select():
    """gx[:, t] in the time loop made every step's backward zero-fill a whole (B, T, G*h) gradient: O(T^2), 97%
    of an IMDB bilstm step. The graph must read the time steps through one unbind."""
    info = DataInfo("text", (6,), 2, "text", 20)
    model = models.build("bilstm", info, hidden=4, embed_dim=3, dense=4)
    out = model(torch.randint(1, 20, (2, 6))).sum()
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    assert "UnbindBackward0" in names
    assert "SelectBackward0" not in names
