"""rlhf-train-deepspeed: the DeepSpeed training backend of rlhf (Ray workers, SFT/RM/DPO/KTO/PRM/KD trainers).

Heavy imports (deepspeed, ray) happen inside the modules that need them; importing this package is cheap.
"""

__version__ = "0.1.0"
