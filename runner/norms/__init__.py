"""Per-layer per-example gradient norm rules, a registry keyed by module type (one file per layer family).

    from runner.norms import RULES, plan_model, Recorder
    plan = plan_model(model)                 # every trainable parameter covered, or a one-line DprunError
    with Recorder(plan) as rec:
        losses = loss_fn(model(x), y)        # (B,)
    rec.backprops(losses.sum(), retain_graph=False)
    norms_sq = sum(rule.norm_sq(m, a, g, "auto") for _, m, rule, a, g in rec.layers())   # (B,)

Families: linear.py (Linear; also the recurrent cells and attention projections), conv.py (Conv1d, Conv2d),
embedding.py (Embedding), normalization.py (LayerNorm, GroupNorm, RMSNorm). Each file registers its rule when
imported below; tests/test_norm_rules.py checks that every family is registered.
"""
from runner.norms import conv, embedding, linear, normalization  # noqa: F401  (each file registers its rules)
from runner.norms.base import HOW, RULES, NormRule, register, rule_for  # noqa: F401
from runner.norms.coverage import Plan, plan_model  # noqa: F401
from runner.norms.hooks import Recorder  # noqa: F401
