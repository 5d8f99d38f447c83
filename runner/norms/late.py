"""Book-keeping's late layers (issue 31): a kept per-example gradient formed after the backward, chunk by chunk,
with its clipped sum, so that it never adds to the backward's memory peak.

Book-keeping keeps a Linear's per-example gradient G_i (B x o x k) when that is cheaper than a GEMM over the B*T
rows for its clipped sum (runner/norms/outer.py `keeps`). Formed inside the backward, at the layer's hook, G_i stays
alive until the clipped sums and meets everything the rest of the backward holds: the IMDB transformer's feed-forward
G_i (32, 200, 800), 19.5 MB, sat on its ReLU backward, the non-private step's own peak (93.1 against 74.1 MB; with
no G_i kept, 74.4 MB but 1.42x the non-private step's time, one more GEMM per layer). A late layer instead:

- gets no tensor hook: its output-gradient comes back from the backward by its gradient edge (streaming.py's
  capture, with no output held), and its (input, output-gradient) records wait for the backward's end. The input is
  the activation autograd holds for the layer's own backward anyway, the output-gradient often the residual
  stream's; what they cost after the backward is less than the activations autograd then frees;
- after the backward, every late layer's G_i is formed for a chunk of examples at a time. The chunk's norms are its
  early norms (every other layer's, summed in the backward) plus the late layers' (the same rule and stash as inside
  the backward: `LinearRule.norm_sq` keeps the very G_i it measured), so the chunk's clip factors
  nu_i = min(1, C / N_i) are final (each depends on example i alone), and the chunk's clipped sums nu_c @ G_c are
  added to the layer's running sum before the next chunk's G is formed. Nothing is formed twice: the step does the
  same multiply-adds as keeping G_i whole, with at most one chunk of G alive.

    late = LateLayers(how, keep_ratio)                       # the lean recorder collects its records
    late.add(path, module, rule, inp, grad)                  # one call's records, from the backward
    norms, nu, sums = late.finish(early_sq, layers, factors) # (B,), (B,), {id(parameter): clipped sum}

Exact and certified as before: a chunk's norm is the same certified bound of the same tensors (per-example, so
chunking changes nothing), summed with the other layers' in any order (certified_norms' gamma_{layers} covers it);
a row with nu = 0 (a non-finite norm) is masked in the chunk's sums (certify.finite_rows). Only a Linear called once
whose G_i book-keeping would keep on the direct route goes late (LeanRecorder.goes_late); a module called again is
formed as usual.
"""
from __future__ import annotations

import math

import torch

from runner.norms.certify import certified_norms, clipped_sums_of, exact_float32, kept
from runner.norms.keep_budget import extra_per_example
from runner.norms.outer import Stash, keeps, use_ghost
from runner.norms.streaming import summed_terms

# the late layers' per-example gradients alive at once: one chunk of examples, at most this fraction of the late
# layers' own records (held until the chunks are done) ...
LATE_CHUNK_FRACTION = 0.25
# ... or this many bytes if more: below it the chunks' extra kernels cost more than the memory they save
LATE_FLOOR_BYTES = 2**22


def late_shape(module, inp: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int] | None:
    """(T, k, o) of a Linear call on a float32/float64 sequence (B, ..., k), T > 1 positions per example; None
    otherwise (one position: the rank-one bound keeps no G_i; bf16 or autocast records: the tensor-core route)."""
    if not isinstance(module, torch.nn.Linear) or inp.dtype not in (torch.float32, torch.float64) \
            or out.dtype != inp.dtype or inp.dim() < 3 or inp.shape[0] == 0:
        return None
    k, o = module.in_features, module.out_features
    T = inp.numel() // (inp.shape[0] * k)
    return (T, k, o) if T > 1 else None


def goes_late(module, inp: torch.Tensor, out: torch.Tensor, how: str, keep) -> bool:
    """Would book-keeping keep this Linear call's G_i, formed directly (outer.norm_sq's choice for the shapes), with
    a fixed ratio (method.keep)? method.keep_mb's budget decides per step and in backward order: not late."""
    shape = late_shape(module, inp, out)
    if shape is None or not isinstance(keep, (int, float)) or isinstance(keep, bool) \
            or not module.weight.requires_grad:
        return False
    T, k, o = shape
    return keeps(T, k, o, keep) and not use_ghost(T, k, o, how, stash=True)


class LateLayers:
    def __init__(self, how: str, keep: float):
        self.how, self.keep = how, keep
        self.records: list[tuple] = []  # (path, module, rule, input (B, ..., k), output-gradient (B, ..., o))

    def __len__(self) -> int:
        return len(self.records)

    def add(self, path: str, module, rule, inp: torch.Tensor, grad: torch.Tensor) -> None:
        self.records.append((path, module, rule, inp, grad))

    @staticmethod
    def chunk(B: int, chunked: list, held: int) -> int:
        """Examples per chunk: the chunked layers' G_i of one chunk within LATE_CHUNK_FRACTION of `held`, the late
        layers' records' bytes (or LATE_FLOOR_BYTES), chunks of nearly equal size."""
        per_example = sum(m.in_features * m.out_features * i.element_size() for _, m, _, i, _ in chunked)
        budget = max(LATE_CHUNK_FRACTION * held, LATE_FLOOR_BYTES)
        size = max(1, min(B, int(budget // max(per_example, 1))))
        size = math.ceil(B / math.ceil(B / size))  # nearly equal chunks
        # a multiple of the threads where it can be: a CPU bmm shares its examples among them (11 on 2 cores: one
        # waits for the other's sixth)
        threads = torch.get_num_threads() if records_device(chunked).type == "cpu" else 1
        return min(B, math.ceil(size / threads) * threads) if size >= threads else size

    @torch.no_grad()
    def finish(self, early_sq: torch.Tensor, layers: int, clip_factors) -> tuple:
        """early_sq (B,): the other layers' summed certified squared norms; layers: every layer's count (theirs and
        these). -> (B,) certified norms, (B,) clip factors clip_factors(norms), {id(parameter): clipped sum} of the
        late layers. The records are released.

        Two kinds of late layer. A G_i no larger than its records (`whole`: extra_per_example <= 0, an attention
        projection) is formed for the whole batch first, layer by layer, its records dropped as it is: held memory
        only goes down, and one bmm per layer. A larger one (`chunked`: a feed-forward layer) is formed a chunk of
        examples at a time, with its clipped sum, once the chunk's clip factors are known."""
        B = early_sq.shape[0]
        records, self.records = self.records, []
        held = sum(i.numel() * i.element_size() + g.numel() * g.element_size() for _, _, _, i, g in records)
        whole = [r for r in records if extra_per_example(*late_shape_of(r)) <= 0 or B == 0]
        chunked = [r for r in records if not (extra_per_example(*late_shape_of(r)) <= 0 or B == 0)]
        del records  # each whole layer's records are dropped once its G_i is formed
        terms, formed = [early_sq], []
        while whole:
            _, module, rule, inp, grad = whole.pop(0)
            a, g = rule.sequence(module, inp, grad)  # (B, T, k), (B, T, o)
            stash = Stash(self.keep)
            with exact_float32(g.device):
                terms.append(rule.norm_sq(module, a, g, self.how, stash).detach())  # (B,); G_i kept in stash
            formed.append((module, rule, stash))
            del a, g, inp, grad  # this layer's records: freed unless another layer shares them
        early_sq = summed_terms(terms, early_sq) if len(terms) > 1 else early_sq
        if chunked:
            norms, nu, sums = self.chunked(chunked, early_sq, layers, clip_factors, self.chunk(B, chunked, held))
        else:
            norms = certified_norms(early_sq, layers)
            nu, sums = clip_factors(norms), {}
        with exact_float32(early_sq.device), clipped_sums_of(nu, kept(nu), all_kept=every_kept(nu)):
            for module, rule, stash in formed:
                for name, s in rule.clipped_sums(module, None, None, nu, stash).items():
                    sums[id(getattr(module, name))] = s
        return norms, nu, sums

    def chunked(self, chunked: list, early_sq: torch.Tensor, layers: int, clip_factors, size: int) -> tuple:
        """The chunked layers: per chunk of `size` examples, each layer's G_i and norm, the chunk's clip factors,
        then its clipped sums. -> (B,) norms, (B,) clip factors, {id(parameter): clipped sum}."""
        B = early_sq.shape[0]
        norms, nus, sums = [], [], {}
        for start in range(0, B, size):
            rows = slice(start, start + size)
            pieces = []
            for _, module, rule, inp, grad in chunked:
                a, g = rule.sequence(module, inp[rows], grad[rows])  # (n, T, k), (n, T, o) views
                stash = Stash(self.keep)
                with exact_float32(g.device):
                    pieces.append((a, g, stash, rule.norm_sq(module, a, g, self.how, stash).detach()))  # (n,)
            total = summed_terms([early_sq[rows]] + [p[3] for p in pieces], early_sq[rows])  # (n,)
            chunk_norms = certified_norms(total, layers)  # (n,)
            nu = clip_factors(chunk_norms)  # (n,); 0 where not finite
            with exact_float32(early_sq.device), clipped_sums_of(nu, kept(nu), all_kept=every_kept(nu)):
                for (_, module, rule, _, _), (a, g, stash, _) in zip(chunked, pieces):
                    for name, s in rule.clipped_sums(module, a, g, nu, stash).items():
                        key = id(getattr(module, name))
                        sums[key] = s if key not in sums else sums[key].add_(s)
            del pieces
            norms.append(chunk_norms)
            nus.append(nu)
        return torch.cat(norms), torch.cat(nus), sums


def every_kept(nu: torch.Tensor) -> bool:
    """Is every clip factor positive (no row to mask: certify.finite_rows passes the tensors as they are)? Read once
    per chunk on the CPU; on a GPU False (the rows masked: no read from the device)."""
    return nu.device.type == "cpu" and bool((nu > 0).all())


def records_device(records: list) -> torch.device:
    return records[0][3].device


def late_shape_of(record: tuple) -> tuple[int, int, int]:
    """(T, k, o) of a late layer's record (path, module, rule, input, output-gradient)."""
    _, module, _, inp, _ = record
    k, o = module.in_features, module.out_features
    return inp.numel() // max(inp.shape[0] * k, 1), k, o
