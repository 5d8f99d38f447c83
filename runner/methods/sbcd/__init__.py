"""DP-SBCD (`method=sbcd`), one package: the released network (net.py), the block updates on the lifted objective
(updates.py), the constants its privacy rests on and the step the accountant is told (bounds.py), the noise
schedule (schedule.py), and the method that runs them in order (method.py). The mechanism type, HiddenStateStep,
lives with the others in runner/accountants/mechanisms.py; the accountant is runner/accountants/hsa.py.
"""
from runner.methods.sbcd.method import SBCD  # noqa: F401  (registers method=sbcd)
