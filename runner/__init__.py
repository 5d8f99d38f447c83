"""dprun: an experiment runner for fast differentially private deep learning."""

__version__ = "0.1.0"
