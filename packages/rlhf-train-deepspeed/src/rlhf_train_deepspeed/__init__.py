"""rlhf-train-deepspeed."""

__version__ = "0.1.0"
