"""The ``rlhf`` command.

    rlhf train {ppo,sft,rm,dpo,kto} [--config run.yaml] [flags] [--dry-run]
    rlhf plugins [--json]
    rlhf serve-rm [flags]
    rlhf lora-merge [flags]
    rlhf doctor
    rlhf demo [--quick]
"""

from __future__ import annotations

import json
import sys

from rlhf_cli.assemble import RunConfigError, assemble, write_run_dir
from rlhf_core import plugins
from rlhf_core.config import MODES
from rlhf_core.config_parser import ConfigError, build_argparser, config_to_yaml, parse_config

USAGE = __doc__.split("\n", 2)[2]


def cmd_train(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES:
        print(f"usage: rlhf train {{{','.join(MODES)}}} [flags] [--dry-run]", file=sys.stderr)
        return 2
    mode, rest = argv[0], argv[1:]
    if "-h" in rest or "--help" in rest:
        build_argparser(mode).print_help()
        print("\n  --config FILE        YAML file with any of the options above (repeatable)"
              "\n  --dry-run            print the resolved config and placement plan, start nothing")
        return 0
    dry_run = "--dry-run" in rest
    rest = [a for a in rest if a != "--dry-run"]
    try:
        cfg, notes = parse_config(mode, rest)
        asm = assemble(mode, cfg)
    except (ConfigError, RunConfigError, plugins.PluginError) as exc:
        print(f"rlhf train {mode}: {exc}", file=sys.stderr)
        return 2
    for note in notes + asm.notes:
        print(f"note: {note}", file=sys.stderr)
    if dry_run:
        print(f"# rlhf train {mode} --dry-run: resolved configuration (nothing was started)")
        print(config_to_yaml(cfg, mode), end="")
        print("# " + asm.describe().replace("\n", "\n# "))
        return 0
    write_run_dir(asm)
    if mode == "ppo":
        from rlhf_cli.rl.run import run_rl

        return run_rl(asm)
    backend = plugins.resolve(plugins.get_plugin_manager(), "train_backends", cfg.train.backend)
    backend.run_trainer(mode, cfg)
    return 0


def cmd_plugins(argv: list[str]) -> int:
    as_json = "--json" in argv
    try:
        info = plugins.describe(plugins.get_plugin_manager())
    except plugins.PluginError as exc:
        print(f"rlhf plugins: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    for dist in info:
        print(f"{dist['distribution']} {dist['version']}")
        if not dist["seams"]:
            print("  (registers nothing)")
        for seam, names in dist["seams"].items():
            print(f"  {seam:<22} {', '.join(sorted(names))}")
    return 0


def cmd_serve_rm(argv: list[str]) -> int:
    from rlhf_agents.serve_rm import main as serve_main

    return serve_main(argv) or 0


def cmd_lora_merge(argv: list[str]) -> int:
    from rlhf_train_deepspeed.cli_lora import main as lora_main

    return lora_main(argv) or 0


def cmd_demo(argv: list[str]) -> int:
    from rlhf_cli.demo import main as demo_main

    return demo_main(argv)


def cmd_doctor(argv: list[str]) -> int:
    from rlhf_cli.doctor import main as doctor_main

    return doctor_main(argv) or 0


COMMANDS = {
    "train": cmd_train,
    "plugins": cmd_plugins,
    "serve-rm": cmd_serve_rm,
    "lora-merge": cmd_lora_merge,
    "doctor": cmd_doctor,
    "demo": cmd_demo,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage:\n" + USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
