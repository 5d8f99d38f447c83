"""Samplers: Poisson batches are Binomial(N, q) with each example in w.p. q; shuffle/fixed cover each index once."""
import pytest
import torch

from runner.data.sampler import Sampler
from runner.errors import DprunError


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_poisson_batch_sizes_are_binomial_and_inclusion_is_q():
    n, b = 1000, 100  # q = 0.1
    s = Sampler("poisson", n, b, gen())
    assert s.sample_rate == 0.1 and s.steps_per_epoch == 10
    batches = [idx for _ in range(200) for idx in s.epoch()]  # 2,000 batches
    sizes = torch.tensor([len(i) for i in batches], dtype=torch.float64)
    assert len(batches) == 2000
    assert abs(sizes.mean().item() - n * 0.1) < 1.5  # sd of the mean: sqrt(90 / 2000) = 0.21
    assert abs(sizes.var().item() - n * 0.1 * 0.9) < 15  # Binomial variance 90; sd of the estimate ~2.9
    for idx in batches[:50]:
        assert idx.dtype == torch.int64 and bool((idx[1:] > idx[:-1]).all())  # distinct, in range
        assert idx.numel() == 0 or (0 <= int(idx.min()) and int(idx.max()) < n)
    counts = torch.bincount(torch.cat(batches), minlength=n).double()  # each ~ Binomial(2000, 0.1): 200 +- 13.4
    assert abs(counts.mean().item() - 200) < 1.5
    assert (counts - 200).abs().max().item() < 5 * 13.4
    # the inclusion events of two examples are independent: their co-occurrence rate is q^2
    both = sum(int((i == 0).any() and (i == 1).any()) for i in batches) / len(batches)
    assert abs(both - 0.01) < 0.008  # sd 0.0022


def test_poisson_batch_can_be_empty():
    s = Sampler("poisson", 100, 1, gen())  # q = 0.01: P(empty) = 0.99^100 = 0.37
    sizes = [len(i) for _ in range(3) for i in s.epoch()]
    assert len(sizes) == 300 and 0 in sizes
    assert 0.25 < sizes.count(0) / len(sizes) < 0.5


def test_shuffle_covers_every_index_once_per_epoch():
    s = Sampler("shuffle", 103, 10, gen())
    assert s.steps_per_epoch == 11
    orders = []
    for _ in range(3):
        batches = list(s.epoch())
        assert [len(b) for b in batches] == [10] * 10 + [3]
        flat = torch.cat(batches)
        assert torch.equal(flat.sort().values, torch.arange(103))
        orders.append(flat)
    assert not torch.equal(orders[0], orders[1])  # a new permutation each epoch


def test_fixed_reuses_the_same_disjoint_batches():
    s = Sampler("fixed", 50, 8, gen())
    first, second = list(s.epoch()), list(s.epoch())
    assert len(first) == s.steps_per_epoch == 7
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(torch.cat(first).sort().values, torch.arange(50))  # disjoint and covering


def test_bad_sampler_arguments_are_one_line_errors():
    with pytest.raises(DprunError, match="did you mean 'poisson'") as e:
        Sampler("poison", 10, 2, gen())
    assert "\n" not in str(e.value)
    with pytest.raises(DprunError, match="batch_size=20"):
        Sampler("poisson", 10, 20, gen())


@pytest.mark.parametrize("n,b", [(60000, 256), (50000, 256), (25000, 64), (1_000_000, 100), (7, 3)])
def test_the_seeded_poisson_rate_is_at_most_q_over_every_uniform_torch_can_draw(monkeypatch, n, b):
    """torch.rand's float32 uniforms are the 2^24 values k / 2^24, equally likely. Fed all of them, the mask includes
    a fraction of them that is the realised inclusion rate: at most q = b / n (the accountant's), within 2^-24.
    `u < q` included ceil(q 2^24) of them: a rate above q (MNIST's 256 / 60,000: 71,583 / 2^24 > q)."""
    from runner import randomness

    grid = torch.arange(2**24, dtype=torch.float32) / 2**24  # every value torch.rand returns, each once
    assert torch.equal(grid * 2**24, torch.arange(2**24, dtype=torch.float32))  # exact in float32
    monkeypatch.setattr(randomness.torch, "rand", lambda m, generator=None: grid)
    rate = int(randomness.poisson_mask(gen(), n, b).sum()) / 2**24
    assert rate <= b / n and b / n - rate < 2**-24
