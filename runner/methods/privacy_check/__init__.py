"""The privacy validator: refuse, in one line, what per-example clipping cannot bound (issue 32; docs/privacy.md).

    check_modules(model, method)                       # at attach: Embedding(max_norm), tracked InstanceNorm
    check_first_step(method, model, loss_fn, x, y)     # the first step: coupling, writes, paths, shapes
    seed = shared_seed(seed, generator, world)         # torch.distributed: rank 0's sampling seed on every rank
    check_ranks(world, x, y, sampler)                  # every rank holds the same data and draws the same batch
    check_collate(dataset, collate, method)            # make_private's DataLoader: rows built per example

Method.validate calls check_modules and Method.clipped_sum calls check_first_step, so the CLI, the API, the compiled
step and chunked batches all run them; `privacy_check=false` (make_private(validate=False)) skips the first-step
check, and the run's privacy notes then say the guarantee is unchecked (UNCHECKED).
"""
from runner.methods.privacy_check.collate import check_collate  # noqa: F401
from runner.methods.privacy_check.first_step import check_first_step  # noqa: F401
from runner.methods.privacy_check.modules import check_modules  # noqa: F401
from runner.methods.privacy_check.ranks import check_ranks, shared_seed  # noqa: F401

UNCHECKED = ("privacy_check=false: the model and loss were NOT checked for what per-example clipping cannot bound "
             "(batch coupling, data written by the forward, parameters used outside their module, non-batch inputs): "
             "the privacy guarantee is unchecked")
