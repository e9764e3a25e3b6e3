"""The training commands printed in the seed documents (../shared/seeds), for the parsing tests.

Each command's launcher prefix (``deepspeed --module openrlhf.cli.train_rm``, ``ray job submit ... --
python3 -m openrlhf.cli.train_ppo_ray``) is replaced by ``rlhf train <mode>``: only its flags are kept.
The documents elide arguments with ``...`` ("other training args"); those placeholders are dropped.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
MODULE_MODE = {
    "train_ppo_ray": "ppo",
    "train_ppo": "ppo",
    "train_rm": "rm",
    "train_dpo": "dpo",
    "train_sft": "sft",
    "train_kto": "kto",
}
_START = re.compile(r"openrlhf\.cli\.(train_\w+)")


@dataclass
class SeedCommand:
    source: str  # file:line
    mode: str
    argv: list[str]


def seed_commands() -> list[SeedCommand]:
    found = []
    for path in sorted(SEEDS.glob("*.txt")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = _START.search(line)
            if not m or m.group(1) not in MODULE_MODE:
                continue
            text = line[m.end() :]
            j = i
            while (text.rstrip().endswith("\\") or text.strip().endswith("...")) and j + 1 < len(lines):
                text = text.rstrip().removesuffix("\\") + " "
                j += 1
                if lines[j].strip().startswith("#"):
                    continue
                text += lines[j]
            text = text.split(" #")[0]
            argv = [t for t in shlex.split(text) if t != "..."]
            found.append(SeedCommand(f"{path.name}:{i + 1}", MODULE_MODE[m.group(1)], argv))
    return found
