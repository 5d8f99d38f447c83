"""Whether a forward feeds a layer the examples in another order than the batch's, seen by forwards alone on the whole
first batch and on the training records at the extremes of every feature the batch's rows tie on.

    check_row_order(method, model, x)     # DprunError (one line) naming the first layer fed reordered rows

Per-layer methods (reweight, the Opacus peer) take row i of every call of a layer to be example i. A forward that
sorts the batch by a key and restores the order afterwards (packing texts by length) breaks that on every batch
whose keys differ; the probe's rows (first_step.py: a few of the first batch, a few training records with extreme
general keys) may all tie on that key. Measured before this check (docs/privacy.md): a stable sort by one feature of
24, 0.3 in 99% of the records and 0.4 in 1%, released 1.6-2.8 C per example under twopass and recompute.

A model whose rows are independent is permutation-equivariant layer by layer: the batch permuted, each call's input
rows come permuted alike. A sort is not, on any two rows whose keys differ. So the check runs one forward of the
rows as drawn and two in shuffled orders, one fixed and one drawn afresh (gradients on, as in training; not reversed:
a forward that reverses the batch commutes with that), and matches every covered call's input rows: each row, centred and projected on a few
fixed random directions (`sketch`), must lie nearest its own example's row of the other order (`moved`), not a
tolerance away from it (review 10: rows of norm 480 differing by 0.1 passed a relative tolerance of 1e-3). The rows: every
row of the first batch (those with a nan input too: review 14), and, where the training set is in memory (probe_rows.feature_extremes), training
records (read as the batch holds them) lying outside the batch's range on each feature whose training range reaches beyond it (`covering`: a rare
flag's records; a text longer or shorter than the batch's), up to EXTRA_RECORDS. Randomness in the forward (dropout) would differ between the two orders:
dropout modules run in eval mode, and where the orders differ, a forward that is still random (torch drew random
values in it, or a second forward of the same rows differs) is compared again in train mode with every draw fixed
(no_randomness: a sort done in train mode only, behind F.dropout) and in eval mode.

What it cannot see: a key that is a function of several features (or of a feature of a layer's output) on which the
first batch and the added records tie, differences below the rounding floor, a reorder among identical rows (the
probe's twin with another label catches that: first_step.py with_twin), and a model that behaves otherwise when
dropout is off or when it is being checked (a reorder only in training mode, drawn from randomness outside torch, or
from a draw whose fixed value happens not to reorder). Under reduced arithmetic (TF32 on CUDA, bf16), rows nearer than its floor (1e-3 of their norm)
reordered only under that arithmetic (`check_row_order`'s two passes; about sqrt(M + 1) C over M such layers,
review 35)."""
from __future__ import annotations

import contextlib
import secrets
from typing import NamedTuple

import torch
from torch import nn

from runner import fp32_mode
from runner.errors import DprunError
from runner.methods.privacy_check.modules import dropout_off
from runner.methods.rng import rng_state, set_rng_state
from runner.methods.privacy_check.no_randomness import ENDS, counted_draws, no_randomness, not_the_models
from runner.methods.privacy_check.probe_rows import like_batch
from runner.methods.privacy_check.shapes import BLACK_BOX, each_call_input

EXTRA_RECORDS = 256  # training records added at most (the cost: two forwards without gradients of these rows)
SKETCH = 4  # random directions each call's centred input rows are projected on (row matching by nearest sketch)
ROWS_AT_ONCE = 64  # rows of a call's input upcast to float64 at a time
COLUMNS_AT_ONCE = 4096  # columns of a call's input at a time in column_scale
FLOAT64_ROUNDING = 1e-12  # moved's floor for a float64 call (~D ulps of the float64 sketch at D = 10^4; a float32
# floor there let rows of a common offset of 1e9 differing by 1 through)


def rows_to_check(method, x: torch.Tensor) -> torch.Tensor:
    """(n, ...) training records holding values outside the range of the batch's finite entries (`covering`), read
    as the batch holds them, then the batch's rows, those with an entry that is not finite included (review 14: a
    record with a nan input that the model imputes trains like any other; a sort by a flag only such records carry
    moves the finite rows, whose sketches show it; a row's own sketch that is not finite is never matched)."""
    found = getattr(method, "probe_features", None)
    flat = x.reshape(len(x), -1)  # (n, d)
    if found is None or len(x) == 0 or found.largest.numel() != flat.shape[1]:
        return x
    candidates = list(dict.fromkeys(torch.cat([found.at_largest, found.at_smallest]).tolist()))  # distinct records
    got = found.records(torch.tensor(candidates))
    values = like_batch(got[0], x, "the training records at each feature's extremes") if got is not None else None
    if values is None:
        return x
    if flat.is_floating_point():  # the batch's range over its finite entries ((d,) each; -inf / inf on none)
        bad = ~torch.isfinite(flat)
        high, low = flat.masked_fill(bad, float("-inf")).amax(0), flat.masked_fill(bad, float("inf")).amin(0)
    else:
        high, low = flat.amax(0), flat.amin(0)
    index = covering(values.reshape(len(values), -1), high, low)
    return torch.cat([values[index], x]) if index else x


def covering(values: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> list[int]:
    """Rows of values ((c, d): the records holding some feature's largest or smallest value), up to EXTRA_RECORDS,
    such that every feature whose training range reaches beyond the batch's [low, high] has a record outside it:
    chosen greedily, the record outside on the most features not yet covered first, those of the features the
    batch's rows tie on (a rare flag) before the others. A few records cover most: a long text every padded position
    of a batch of shorter ones."""
    outside = (values > high) | (values < low)  # (c, d): candidate c lies outside the batch's range on feature d
    order = []
    for needed in (high == low, high != low):  # tied features first
        left = needed & outside.any(0)  # (d,) features still to cover
        while bool(left.any()) and len(order) < EXTRA_RECORDS:
            best = int((outside & left).sum(1).argmax())
            order.append(best)
            left &= ~outside[best]
    return list(dict.fromkeys(order))


def column_scale(inp: torch.Tensor) -> torch.Tensor:
    """(D,) float64: each coordinate of one call's input (n, ...) at the lower median of its finite non-zero magnitudes
    over the rows (1 where there are none): the units `sketch` measures rows in. A median, not the largest: one
    training record of 1e9 on every feature (added to the check because it lies outside the batch's range) set every
    column's unit, the other rows' differences fell ~1e-9 in those units, below the floor, and a swap of two rows
    passed (review 16: twopass 1.9-2011 C on 20 of 21 seeds). The lower median is one of the rows' own magnitudes,
    which a single record moves only where it is the column's sole non-zero entry (nothing else there to hide).
    Columns at a time, in the input's dtype (a (n, COLUMNS_AT_ONCE) block)."""
    flat = inp.detach().reshape(len(inp), -1)
    parts = []
    for block in flat.split(COLUMNS_AT_ONCE, dim=1):  # (n, <= COLUMNS_AT_ONCE)
        size = block.abs() if block.dtype in (torch.float32, torch.float64) else block.abs().float()  # ids, bf16
        size = size.masked_fill(~torch.isfinite(size) | (size == 0), float("nan"))
        parts.append(size.nanmedian(0).values.double())  # lower median; nan where the column has no finite non-zero
    scale = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float64)
    # no unit below UNIT_FLOOR of the largest column's: a column holding only rounding noise (a masked BiLSTM's
    # float64 rows, ~1e-17) measured in its own units turned that noise into whole units and refused sound models
    top = float(scale.nan_to_num(nan=0.0).max()) if scale.numel() else 0.0
    floor = UNIT_FLOOR.get(inp.dtype, UNIT_FLOOR[torch.float32]) * top
    scale = torch.where(torch.isnan(scale), torch.ones((), dtype=torch.float64, device=flat.device), scale)
    return torch.where(scale > floor, scale, max(floor, 1e-300) if top > 0 else 1.0)


# a column's unit at least this share of the largest column's: ~1e3 ulps of the dtype (rounding noise then moves
# a coordinate by <= ~1e-3 of a unit), small enough that review 17's per-row columns (1 over 1e-30) stay visible
UNIT_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def sketch(inp: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(n, SKETCH + 1) float64: each row of one call's input (n, ...) as u = asinh(x / scale) per coordinate (`scale`
    (D,), column_scale: the drawn forward's, so that both orders are measured alike), projected on SKETCH fixed random
    directions (E ||P d||^2 = ||d||^2) less the rows' mean projection (their mean's: the projection is linear), then
    the norm of u. The mean over the same rows does not depend on their order, and u is the same function of each
    coordinate in both, so a call that is permutation-equivariant gives the same sketch rows permuted (up to
    rounding). Rounding moves x_j by about 1 ulp of x_j, which moves u_j by at most that ulp relative (asinh's slope
    is 1 / sqrt(1 + v^2)), so `moved`'s floor (rounding x ||u||) is a rounding model per coordinate in which a large
    coordinate adds its logarithm, not itself: review 14's exact constant column of 1e9 raised a floor of 1e-7 of the
    raw row's norm to ~100 (a sort by a rare flag passed: twopass 1.3e3-7.9e8 C, 1.5e10 C through make_private), and
    review 17's column at 1 where its median was 1e-30 raised a floor of 1e-7 of x / scale to ~1e23 (3.1-3.7 C);
    asinh(1e30) is 69. Centred, a large common offset does not hide a small difference between records (review 10:
    rows of norm 480 differing by 0.1 passed a tolerance of their norm and released 245-367 C per example);
    projected, two forwards' inputs are never held (review 10: 1.3 GB for the transformer at 256 rows); one float64
    pass of ROWS_AT_ONCE rows at a time (review 11: 0.5 s a call at D = 65,536 before). A row that is not finite
    gets nan."""
    flat = inp.detach().reshape(len(inp), -1)
    scale = column_scale(flat) if scale is None else scale  # (D,)
    with not_the_models():  # drawn as drawn under the check's fixed draws too
        directions = torch.randn(flat.shape[1], SKETCH, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(flat.shape[1])).to(flat.device) / SKETCH ** 0.5
    parts = []
    for block in flat.split(ROWS_AT_ONCE):  # (<= 64, D) upcast at a time
        u = torch.asinh(block.double() / scale)  # (<= 64, D)
        parts.append(torch.cat([u @ directions, u.norm(dim=1, keepdim=True)], 1))
    out = torch.cat(parts) if parts else flat.new_zeros(0, SKETCH + 1, dtype=torch.float64)
    finite = torch.isfinite(out).all(1)  # (n,)
    mean = out[finite, :SKETCH].mean(0) if bool(finite.any()) else out.new_zeros(SKETCH)
    out[:, :SKETCH] -= mean
    return torch.where(finite[:, None], out, float("nan"))


class Call(NamedTuple):
    path: str
    module: nn.Module
    shape: torch.Size  # the call's input shape
    dtype: torch.dtype
    sketch: torch.Tensor | None  # (n, SKETCH + 1); None for a call whose input is not batch-first
    scale: torch.Tensor | None  # (D,) column_scale


def call_sketches(model: nn.Module, x: torch.Tensor, scales: list[Call] | None = None) -> list[Call]:
    """Every call of a covered module in one forward of x, in call order; `scales`: another forward's calls, whose
    coordinate scales the sketches take (the drawn order's)."""
    calls = []

    def visit(path, module, inp):
        rows = inp.dim() > 0 and len(inp) == len(x)  # batch-first (check_batch_first refuses the others)
        scale = None
        if rows:
            given = scales[len(calls)].scale if scales is not None and len(calls) < len(scales) else None
            scale = given if given is not None and given.numel() == inp[0].numel() else column_scale(inp)
        calls.append(Call(path, module, inp.shape, inp.dtype, sketch(inp, scale) if rows else None, scale))

    each_call_input(model, x, visit)
    return calls


def moved(drawn: torch.Tensor, permuted: torch.Tensor, order: torch.Tensor, rounding: float) -> bool:
    """Some row i of `permuted` lies much nearer another row of `drawn` than its own, drawn[order[i]], and further from
    its own than `rounding` (relative to the row's norm in the sketch's units, u) explains, or lies further from its
    own than LARGE_MOVE times that (sketches (n, SKETCH + 1)): the call saw that example's row elsewhere, or another
    row. Distances are exact differences (torch.cdist's matrix-product route put exact duplicates ~1e-8 of their norm
    apart, and the rounding then put a twin nearer than a row's own: review 11, and the real IMDB's texts that open
    alike); rows that are not finite are never counted. The second test: a swap whose rows also carry columns of
    their own (a per-row bucket one-hot computed after the swap) left each moved row far from every drawn row, its
    own included, so no other row was nearer (review 17: twopass 3.1-3.7 C)."""
    distance = torch.cdist(permuted[:, :SKETCH], drawn[:, :SKETCH], compute_mode="donot_use_mm_for_euclid_dist")
    rows = torch.arange(len(order), device=order.device)
    own = distance[rows, order]  # (n,)
    distance[rows, order] = float("inf")
    nearest = distance.nan_to_num(nan=float("inf")).amin(1)  # (n,)
    # + the sketch's own float64 rounding (its centring), which a row of norm 0 (a fully masked example) has too
    tiny = SKETCH_ROUNDING * float(drawn[:, SKETCH].nan_to_num(nan=0.0, posinf=0.0).max()) if len(drawn) else 0.0
    floor = rounding * drawn[order, SKETCH] + tiny  # (n,)
    large = min(LARGE_MOVE * rounding, LARGE_MOVE_CAP) * drawn[order, SKETCH] + tiny  # (n,)
    return bool((((nearest < 0.5 * own) & (own > floor)) | (own > large)).logical_and(torch.isfinite(own)).any())


SKETCH_ROUNDING = 1e-12  # of the rows' largest norm: float64 centring moved an all-zero row by 5.6e-17 (norm 1.6)
LARGE_MOVE, LARGE_MOVE_CAP = 1e4, 5e-2  # a row further from its own than 1e4 rounding floors, at most 5% of its norm
# (1e-3 in float32, 5e-2 under bf16's 1e-3 floor, 1e-8 for a float64 call), moved whatever its neighbours


def shuffles(n: int) -> list[torch.Tensor]:
    """Three (n,) permutations that are not the identity, drawn from their own generators (the run's random state is
    not touched): one fixed by n (a check that reads the same every time), one drawn afresh from the OS's randomness (a
    model applying the fixed one itself released 9-15 C: review 11), and that one read backwards. Every pair of rows
    then meets in both relative orders, so a reorder that swaps two rows by their data (a sort among near neighbours)
    shows in one of the last two forwards whatever the draw (with the two random orders alone it hid on a quarter of
    the draws when the batch held one such pair). None is the reversal, which a forward that itself reverses the
    batch commutes with (the third is the second composed with it: it commutes only if the second does)."""
    orders = [torch.randperm(n, generator=torch.Generator().manual_seed(seed)) for seed in (n, secrets.randbits(63))]
    orders = [o if not bool((o == torch.arange(n)).all()) else o.roll(1) for o in orders]
    backwards = orders[1].flip(0)
    return orders + ([backwards] if not bool((backwards == torch.arange(n)).all()) else [])


def reordered(model: nn.Module, rows: torch.Tensor, rounding: float) -> tuple[str, nn.Module] | None:
    """The first covered call whose input rows, for the rows permuted, are not its input rows permuted; or None."""
    state = rng_state(rows.device, host=True)  # each order's forward from the same random state: a coin per batch
    drawn = call_sketches(model, rows)  # (torch's, Python's, numpy's) is the same coin in each (review 57)
    with not_the_models():  # the check's orders, not fixed by no_randomness
        orders = shuffles(len(rows))
    for order in orders:
        order = order.to(rows.device)
        set_rng_state(state, rows.device)
        permuted = call_sketches(model, rows[order], drawn)
        if [(c.path, c.shape) for c in drawn] != [(c.path, c.shape) for c in permuted]:
            first = next((c for c, d in zip(drawn, permuted) if (c.path, c.shape) != (d.path, d.shape)),
                         drawn[-1] if len(drawn) > len(permuted) else permuted[-1])
            return first.path, first.module
        for a, b in zip(drawn, permuted):
            floor = min(rounding, FLOAT64_ROUNDING) if a.dtype == torch.float64 else rounding
            if a.sketch is not None and moved(a.sketch, b.sketch, order.to(a.sketch.device), floor):
                return a.path, a.module
    return None


def random_forward(model: nn.Module, rows: torch.Tensor) -> bool:
    """The forward draws random values outside the dropout modules already in eval mode: torch's random operators ran
    (a coin per batch for a whole residual branch draws the same value in two forwards half the time, and a sound
    model was refused: stop 64), or two forwards of the same rows differ (numpy's draws; a row that is not finite,
    nan in both, is no difference)."""
    with counted_draws() as seen:
        one = call_sketches(model, rows)
    if seen.draws:
        return True
    two = call_sketches(model, rows, one)
    return len(one) != len(two) or any((a.sketch is None) != (b.sketch is None) or (a.sketch is not None and not (
        torch.equal(a.sketch.nan_to_num(nan=0.0), b.sketch.nan_to_num(nan=0.0)))) for a, b in zip(one, two))


@torch.enable_grad()
def check_row_order(method, model: nn.Module, x: torch.Tensor) -> None:
    """Refuses (one line) a forward that feeds a covered layer the first batch's rows, or the added training records,
    in an order other than theirs (see the module docstring). The caller restores the modules' flags and the RNG."""
    rows = rows_to_check(method, x)
    if len(rows) < 2:
        return
    dropout_off(model)  # the two orders draw different dropout masks per example
    size = max(method.physical_batch_size or len(x), 2)  # rows per forward: the training step's chunk at most
    # rows computed at two batch positions are bitwise equal on the CPU (review 11: Linear, fp32 and bf16); the floor
    # is ~1 ulp per coordinate (sketch's units) for kernels elsewhere that are not (a floor of 1e-3 of the centred
    # norm let near neighbours through: 1.28 C; one of 1e-7 of the raw norm, a constant column of 1e9: review 14)
    rounding = 1e-3 if method.precision == "bf16" else FLOAT32_ROUNDING
    rows = rows[shuffles(len(rows))[0].to(rows.device)]  # each forward mixes added records and batch rows
    # CUDA with TF32 products (precision=tf32): cuDNN's TF32 convolutions round a row by its batch position (stop 62,
    # an H200: ResNet-18's rows 7e-4 of their norm apart in the two orders at its 20th conv, every run alike; 0 in
    # float32), and a sound ResNet-18 was refused at float32's floor. So where the step's arithmetic is reduced (TF32
    # there, or bf16 autocast anywhere), two passes: the step's own arithmetic and flags at its floor (a forward may
    # read them: review 34's model packed its rows only while TF32 was allowed, and a check with TF32 paused let it
    # release 1.054 C), then float32 products, no autocast, at float32's floor: a reorder among rows nearer than the
    # reduced floor, in a forward that does not depend on the arithmetic (review 35: rows ~1e-5 apart sorted by a rare
    # feature at 3 layers released 2.0 C under bf16, which had the one pass at 1e-3)
    tf32 = tf32_rounds(rows)
    reduced = tf32 or method.precision == "bf16"
    passes = [(lambda: method.autocast(rows), max(rounding, TF32_ROUNDING) if tf32 else rounding)]
    if reduced:
        passes.append((lambda: float32_products(rows), FLOAT32_ROUNDING))
    for arithmetic, floor in passes:
        with arithmetic():
            for part in rows.split(size):
                found = reordered(model, part, floor) if len(part) >= 2 else None
                if found is not None and model.training and random_forward(model, part):
                    found = random_reordered(model, part, floor)
                if found is not None:
                    refuse(method, *found)


def random_reordered(model: nn.Module, rows: torch.Tensor, floor: float) -> tuple[str, nn.Module] | None:
    """reordered for a forward that draws random values (the two orders draw others): compared in train mode with
    every draw fixed (no_randomness at each draw's centre, then at its range's ends; a forward with a draw it cannot fix is refused by the independence check), then in
    eval mode. Eval mode alone passed a sort done in train mode behind F.dropout; the fixed draws alone would pass a
    forward whose order comes from a draw outside torch (numpy), which eval mode may still show. The flags restored."""
    for end in ENDS:  # each draw at its centre, then at its range's ends where the forward draws such values
        with no_randomness(end, forwards=4) as mode:  # the drawn order's forward and three shuffles'
            found = reordered(model, rows, floor)
        if found is not None and not mode.unfixed:
            return found
        if not mode.varied:
            break
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with counted_draws() as seen:
            found = reordered(model, rows, floor)
        if found is not None and seen.draws:  # random in eval mode too (F.rrelu(training=True): review 59)
            with no_randomness(forwards=4) as mode:
                fixed = reordered(model, rows, floor)
            found = found if mode.unfixed else fixed
        return found
    finally:
        for m, training in flags:
            m.training = training


TF32_ROUNDING = 1e-3  # the row-order floor where TF32 products round (10-bit mantissas: 2^-11 per product), as bf16's
FLOAT32_ROUNDING = 1e-7  # float32's: ~1 ulp per coordinate in the sketch's units


def float32_products(rows: torch.Tensor):
    """The check's second pass: float32 products (TF32 paused where it rounds the rows), no autocast."""
    return fp32_mode.tf32_paused() if tf32_rounds(rows) else contextlib.nullcontext()


def tf32_rounds(rows: torch.Tensor) -> bool:
    """Do the check's forwards of `rows` take TF32 products (CUDA, with TF32 on: precision=tf32's step)?"""
    return rows.device.type == "cuda" and fp32_mode.tf32_enabled()


def refuse(method, path: str, module: nn.Module) -> None:
    raise DprunError(f"{path} ({type(module).__name__}) is fed the examples in another order than the "
                     f"batch's (the batch shuffled, its input rows are not shuffled alike): the forward "
                     f"reorders the examples by their data (e.g. a sort by length before packing); "
                     f"method={method.name} takes row i of each call of a layer to be example i, so its "
                     f"norms would not bound the released sum; restore the order before the layer, or use "
                     f"{BLACK_BOX}")
