"""Benchmarks: ratios measured side by side in one process (method / non-private, ours / Opacus), never timed tests.

    python -m runner.bench.clip            # make bench-clip: exact per-example clipping methods (docs/bench.md)
    python -m runner.bench.jl              # make bench-jl: DP-SGD-JL step time vs r, forward-mode vs double-vjp (docs/jl.md)
"""
