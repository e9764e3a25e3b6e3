"""One policy micro-batch's forward and backward on SmolLM2-135M in each layout: CPU seconds and peak RSS.

2 chat-length prompts (46 tokens) x 8 samples with long-tail replies (one per prompt at ``max``, the others
10 + an exponential of mean 60, capped at ``max``), ``response_logprobs`` with entropy, a backward of their
sum. ``layout``: ``shared`` (``--ds.shared_prefix``), ``padded`` (``--ds.shared_prefix false``), or
``shared@REV``: the shared-prompt layout of git revision REV (its ``shared_prefix.py`` and ``models.py``).
One layout per process (the peak RSS is the process's); two repetitions, both printed.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python bench/long_layout.py shared 128
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python bench/long_layout.py shared@d0f8772 128
"""

import importlib.util
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

layout, max_len = sys.argv[1], int(sys.argv[2])
if "@" in layout:  # the revision's modules replace this checkout's before anything imports them
    import rlhf_train_deepspeed

    for name in ("shared_prefix", "models"):
        path = f"packages/rlhf-train-deepspeed/src/rlhf_train_deepspeed/{name}.py"
        text = subprocess.run(
            ["git", "show", f"{layout.split('@')[1]}:{path}"], capture_output=True, check=True
        )
        file = Path(tempfile.mkdtemp()) / f"{name}.py"
        file.write_bytes(text.stdout)
        spec = importlib.util.spec_from_file_location(f"rlhf_train_deepspeed.{name}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        setattr(rlhf_train_deepspeed, name, module)
        spec.loader.exec_module(module)

from transformers import AutoConfig  # noqa: E402

from rlhf_core.batches import make_sequence_batch  # noqa: E402
from rlhf_core.testing.smollm2 import smollm2_dir  # noqa: E402
from rlhf_train_deepspeed import shared_prefix  # noqa: E402
from rlhf_train_deepspeed.models import load_causal_lm, response_logprobs  # noqa: E402

path = str(smollm2_dir())
ds = SimpleNamespace(
    shared_prefix=layout != "padded", attn_implementation="sdpa", packing_samples=False, ring_attn_size=1
)
model = load_causal_lm(
    path, torch.float32, shared_prefix.attn_implementation(AutoConfig.from_pretrained(path), ds)
)
model.train()
rng = random.Random(0)
prompts, responses = [], []
for _ in range(2):
    prompt = [rng.randrange(100, 40000) for _ in range(46)]
    for n in [max_len] + [min(max_len, int(rng.expovariate(1 / 60)) + 10) for _ in range(7)]:
        prompts.append(prompt)
        responses.append([rng.randrange(100, 40000) for _ in range(n)])
batch = make_sequence_batch(prompts, responses, 0)
for _ in range(2):
    t = time.process_time()
    lp, ent, mask = response_logprobs(model, batch, 1.0, with_entropy=True)
    ((lp * mask).sum() + 0.01 * ent.sum()).backward()
    model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{layout} max={max_len} response tokens={sum(map(len, responses))} "
        f"cpu_s={time.process_time() - t:.2f} peak_rss_mib={peak:.0f}",
        flush=True,
    )
