"""Ranks agree: one Poisson sample per step needs every rank to hold the same data and draw the same batches.

    seed = shared_seed(seed, generator, world)    # seed=None on several ranks: rank 0's draw, broadcast
    check_ranks(world, x, y, sampler)             # once: DprunError naming the first rank that differs

Each rank draws the global batch itself and trains on its share (runner/distributed.py). Ranks that seed torch per
rank (common for augmentation) and leave the sampling seed to torch's global RNG would each draw their own Poisson
mask: the union of their shares is not the sample the accountant assumes (9 (example, step) pairs trained twice in
80 steps). So seed=None takes rank 0's seed, and the data and the first batch are compared once across ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runner.collated import tensor_leaves
from runner.methods.privacy_check.collate import seeded

from runner.errors import DprunError


def collective_device(world) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if world.backend == "nccl" else torch.device("cpu")


def shared_seed(seed: int | None, generator, world) -> int | None:
    """The sampling seed every rank uses: `seed` as given; None with no generator on several ranks: rank 0's."""
    if world.size == 1 or seed is not None or generator is not None:
        return seed
    drawn = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(collective_device(world))
    dist.broadcast(drawn, src=0)
    return int(drawn.item())


def fingerprint(t: torch.Tensor | None) -> list[float]:
    """Two float64 sums that differ for different data (a plain and a position-weighted one); [] for None."""
    if t is None:
        return [0.0, 0.0]
    flat = t.detach().reshape(-1).double()
    weights = torch.arange(1, len(flat) + 1, dtype=torch.float64, device=flat.device).remainder_(1009)
    return [float(flat.sum()), float((flat * weights).sum())]


def first_batch(sampler) -> torch.Tensor | None:
    """The indices of the sampler's next batch, drawn from a copy of its generator (its own state is untouched);
    None for a generator with no state to copy (a cryptographic one, which the ranks share by construction)."""
    from runner.data.sampler import Sampler

    if not isinstance(sampler.generator, torch.Generator):
        return None

    gen = torch.Generator(device=sampler.generator.device)
    gen.set_state(sampler.generator.get_state())
    return next(iter(Sampler(sampler.kind, sampler.n, sampler.batch_size, gen, "cpu").epoch()))


SPREAD = 512  # a Dataset's records compared across ranks: the first 8 and this many spread over it


def record_fingerprint(records) -> list[float]:
    """fingerprint of a spread of a Dataset's records, each collated alone, with torch's, numpy's and Python's RNGs
    seeded alike (a random augmentation then draws the same on every rank), each record's pair of sums weighted by a
    number of its index, so that records in another order differ (review 28: a plain sum of the records' sums passed
    two records swapped, and 929 shuffled); [0, 0] without records. Review 24: the DataLoader path compared only the
    sizes, and a rank holding the records in another order (a per-rank shuffle or Subset) trained a record at 2.2 q,
    twice in one step 149 times in 400. A swap of two records neither of which is probed is not seen."""
    if records is None:
        return [0.0, 0.0]
    dataset, collate = records
    n = len(dataset)
    indices = sorted(set(range(min(8, n))) | {i * n // SPREAD for i in range(SPREAD) if n})
    sums = [0.0, 0.0]
    for i in indices:
        weight = 1.0 + (i * 2654435761 % 1000003) / 1000003  # in [1, 2), apart for nearby indices
        for t in tensor_leaves(seeded(i, lambda i=i: collate([dataset[i]]))):
            sums = [a + weight * b for a, b in zip(sums, fingerprint(t))]
    return sums


def check_ranks(world, x: torch.Tensor | None, y: torch.Tensor | None, sampler, records=None) -> None:
    """records: (dataset, collate) on make_private's DataLoader path (record_fingerprint)."""
    if world.size == 1:
        return
    batch = first_batch(sampler) if sampler is not None else None
    mine = torch.tensor([float(sampler.n if sampler is not None else 0), *fingerprint(x), *fingerprint(y),
                         *record_fingerprint(records), *fingerprint(batch)], dtype=torch.float64,
                        device=collective_device(world))
    every = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine)
    for rank, theirs in enumerate(every):
        if not torch.equal(theirs[:7], every[0][:7]):
            raise DprunError(f"rank {rank} holds other training data than rank 0 (size or checksum differ): every "
                             f"rank must pass the same data (and the same seed), since each trains on its share of "
                             f"one global Poisson batch")
        if not torch.equal(theirs, every[0]):
            raise DprunError(f"rank {rank} draws another first batch than rank 0 from the same data: every rank "
                             f"must pass the same seed (or generator state), since each trains on its share of one "
                             f"global Poisson batch")
