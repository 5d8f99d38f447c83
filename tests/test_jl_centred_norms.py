"""jl's estimates and its release through the same centred GroupNorm / InstanceNorm (runner/methods/centred_norms.py).

torch's CPU GroupNorm backward forms its gradients from the raw input (b x + c, and (sum g x - mean sum g) rstd),
which cancel on a group whose mean is large next to its spread, while jl's forward-mode tangents are formed from the
centred values. With the kernel, one crafted example under jl (r = 64, C = 1% of its gradient norm) released 227 C
through a conv under a GroupNorm (1e5 C at a spread of 1e-7) and 15.7 C through a GroupNorm's weight alone (review 25
and its follow-up). Fails without centre_spatial_norms.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.bench.adversarial import CONSTRUCTIONS, FieldReadout, large_mean, measured
from runner.methods.centred_norms import centred_group_norm


def test_the_centred_layer_is_the_kernels_function():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 5, 7, generator=g) * 3 + 1
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    torch.testing.assert_close(centred_group_norm(x, 3, w, b, 1e-5), F.group_norm(x, 3, w, b, 1e-5))
    torch.testing.assert_close(centred_group_norm(x, 6, None, None, 1e-5), F.instance_norm(x, eps=1e-5))
    cl = x.contiguous(memory_format=torch.channels_last)  # the CPU CNNs' layout under jl
    torch.testing.assert_close(centred_group_norm(cl, 2, w, None, 1e-5), F.group_norm(x, 2, w, None, 1e-5))


@pytest.mark.parametrize("jvp", ["forward", "double_vjp"])
def test_jl_releases_about_c_through_a_groupnorm_at_a_large_mean(jvp):
    """Within JL's own spread at r = 64 (its estimate of a norm is off by a factor of 1/sqrt(chi2_64 / 64), above
    1.5 with probability ~1e-6), where the kernel released 227 C (a conv below, forward mode) and 11-15.7 C (the
    GroupNorm's weight)."""
    by_name = {case: (build, example) for cases in CONSTRUCTIONS.values() for case, build, example in cases}
    for case, rel in (("groupnorm8_64x64_large_mean", 6e-8), ("conv_groupnorm_large_mean_image", 1e-5)):
        build, _ = by_name[case]
        torch.manual_seed(0)
        model = build(0)
        shape = (8, 64, 64) if case.startswith("groupnorm") else (3, 32, 32)
        x = large_mean(shape, torch.Generator().manual_seed(1), rel=rel)
        released = measured("jl", {"r": 64, "jvp": jvp}, model, x, 0.01)
        assert released <= 1.5, (case, jvp, released)


@pytest.mark.parametrize("norm", [nn.InstanceNorm2d(8), nn.LayerNorm([30, 30])], ids=["instancenorm", "layernorm_hw"])
def test_an_instancenorm_or_a_layernorm_over_positions_under_jl_is_centred_too(norm):
    """A LayerNorm over a conv's positions (nn.LayerNorm([H, W])) released 1.6e6 C under jl forward mode (review 28:
    its CPU backward forms the input-gradient from the raw input too)."""
    torch.manual_seed(0)
    model = FieldReadout(nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.Tanh()), torch.zeros(1, 3, 32, 32))
    x = large_mean((3, 32, 32), torch.Generator().manual_seed(1), rel=1e-5)
    assert measured("jl", {"r": 64, "jvp": "forward"}, model, x, 0.01) <= 1.5


class FunctionalNorm(torch.nn.Module):
    """A normalisation called functionally in the forward, on parameters of its own: no nn module to centre."""

    def __init__(self, kind):
        super().__init__()
        self.conv, self.kind = nn.Conv2d(3, 8, 3), kind
        self.weight, self.bias = nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8))

    def forward(self, x):
        h = self.conv(x)
        if self.kind == "group_norm":
            return torch.tanh(F.group_norm(h, 8, self.weight, self.bias))
        if self.kind == "layer_norm":
            h = F.layer_norm(h, h.shape[-2:])
        else:  # instance norm as the aten op on (1, B C, H, W) (review 28: its node passed an exact-name list, 13,946 C)
            flat = h.reshape(1, -1, *h.shape[2:])
            h = torch.ops.aten._native_batch_norm_legit.no_stats(flat, None, None, True, 0.0, 1e-5)[0].reshape(h.shape)
        return torch.tanh(h * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1))


@pytest.mark.parametrize("kind", ["group_norm", "layer_norm", "batch_norm_legit"])
@pytest.mark.parametrize("jvp", ["forward", "double_vjp", "auto"])
def test_a_functional_normalisation_is_refused_under_jl_in_one_line(jvp, kind):
    from runner.errors import DprunError

    torch.manual_seed(0)
    model = FieldReadout(FunctionalNorm(kind), torch.zeros(1, 3, 32, 32))
    x = large_mean((3, 32, 32), torch.Generator().manual_seed(1), rel=1e-5)
    with pytest.raises(DprunError, match=r"^method=jl: the model runs a normalisation kernel \(\w+\) "
                                         r"outside an nn.GroupNorm, nn.InstanceNorm or nn.LayerNorm module"):
        measured("jl", {"r": 4, "jvp": jvp}, model, x, 0.01)


class ReflectStack(nn.Module):
    """L x [Conv2d 3x3 (reflect padding) -> InstanceNorm2d(affine) -> Tanh] -> Linear: the style-transfer block. On an
    image of constant pixels every conv's exact gradient is 0, while float32's backward keeps a residue of ~u times
    terms grown 1/sqrt(eps) a layer, which jl's tangents do not see (review 30: 374 C at L = 4, 50,390 C at L = 5)."""

    def __init__(self, layers):
        super().__init__()
        blocks, c = [], 3
        for _ in range(layers):
            blocks += [nn.Conv2d(c, 8, 3, padding=1, padding_mode="reflect"), nn.InstanceNorm2d(8, affine=True), nn.Tanh()]
            c = 8
        self.f = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(8 * 16 * 16, 10))

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize("jvp", ["forward", "double_vjp"])
def test_a_release_that_disagrees_with_its_projections_leaves_that_record_out(jvp):
    """jl compares each chunk's release with its projections (jl.py release_agrees); a record whose release alone
    disagrees is left out (runner/methods/dropped.py), so the crafted image adds nothing and the others as before."""
    ce = lambda out, t: F.cross_entropy(out, t, reduction="none")  # noqa: E731
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    crafted, label = torch.full((1, 3, 16, 16), 0.5), torch.tensor([3])
    from runner.methods import METHODS

    def release(xs, ys):
        torch.manual_seed(0)
        method = METHODS.build("jl", cfg={"r": 64, "jvp": jvp}, clip=1.0, sigma=0.0)
        method.privacy_check = False
        model = method.attach(ReflectStack(4))
        torch.manual_seed(7)  # the step's directions
        out = method.step(model, ce, xs, ys, torch.optim.SGD(model.parameters(), lr=0.0), sample_rate=1.0,
                          expected_batch_size=1.0)
        return torch.cat([p.grad.flatten() for p in model.parameters()]).double(), out.norms

    with_it, norms = release(torch.cat([x, crafted]), torch.cat([y, label]))
    without, honest = release(x, y)
    assert float((with_it - without).norm()) <= 1e-3 and torch.isnan(norms[-1]) and not torch.isnan(norms[:-1]).any()
    assert not torch.isnan(honest).any()


def test_the_release_check_tolerance_grows_like_a_sums_rounding_not_like_the_batch():
    """Review 31: a tolerance of 1e-4 sum_i nu_i M_i let one record spend the whole batch's slack (0.58 C of pure
    residue kept at B = 16384, where it was 1.64 C). It is now 1e-3 C + 1e-4 sqrt(sum_i (nu_i M_i)^2): 0.0138 C at
    B = 16384 with every record clipped, so a residue of 0.1 C is seen; none is accepted."""
    from runner.methods.jl import release_agrees

    g = torch.Generator().manual_seed(0)
    B, r, d = 16384, 64, 50
    directions = {"w": torch.randn(r, d, generator=g)}
    G = torch.randn(d, generator=g)  # the release without a residue: what the projections say
    P = torch.zeros(B, r)
    P[0] = directions["w"] @ G  # one record's projections carry it all; the others project to 0 ...
    norms = torch.ones(B)  # ... while every record's estimate is C = 1 (clipped: nu M = C)
    nu = torch.ones(B)
    assert bool(release_agrees({"w": G}, directions, P, nu, norms, 1.0))
    residue = torch.randn(d, generator=g)
    for size in (0.1, 1.0):
        bumped = G + size * residue / residue.norm()
        assert not bool(release_agrees({"w": bumped}, directions, P, nu, norms, 1.0)), size
