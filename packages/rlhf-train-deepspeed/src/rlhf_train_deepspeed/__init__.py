"""rlhf-train-deepspeed: the DeepSpeed training backend of rlhf (Ray workers, SFT/RM/DPO/KTO/PRM/KD trainers).

Heavy imports (deepspeed, ray) happen inside the modules that need them; importing this package is cheap."""

import importlib.metadata

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-train-deepspeed")
