"""``rlhf lora-merge``: fold a LoRA adapter into its base model and write a plain HF model.

python -m rlhf_cli.lora_merge --base BASE_DIR --adapter ADAPTER_DIR --out OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path


def merge_lora(base_dir: str, adapter_dir: str, out_dir: str, dtype: str = "fp32") -> str:
    """Fold the PEFT adapter ``adapter_dir`` into ``base_dir`` (a causal LM) and save it to ``out_dir``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for flag, path in (("--base", base_dir), ("--adapter", adapter_dir)):
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{flag} {path}: not a directory")
    if not (Path(adapter_dir) / "adapter_config.json").exists():
        raise FileNotFoundError(f"--adapter {adapter_dir}: no adapter_config.json (not a PEFT adapter)")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    for source in (adapter_dir, base_dir):
        try:
            AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)
            break
        except (OSError, ValueError):
            continue
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf lora-merge", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base HF model directory")
    parser.add_argument("--adapter", required=True, help="the LoRA adapter directory (PEFT format)")
    parser.add_argument("--out", required=True, help="where to write the merged model")
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the merged weights"
    )
    args = parser.parse_args(argv)
    print(merge_lora(args.base, args.adapter, args.out, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
