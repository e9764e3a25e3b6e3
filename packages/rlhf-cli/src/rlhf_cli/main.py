"""The ``rlhf`` command.

rlhf train {ppo,sft,rm,dpo,kto,prm,kd} [--config run.yaml] [flags] [--dry-run] [--debug]
rlhf generate [flags] [--dry-run]
rlhf chat [flags]
rlhf plugins [--json]
rlhf serve-rm [flags]
rlhf serve-tinker --base_model DIR [flags]
rlhf lora-merge [flags]
rlhf doctor
rlhf demo [--real] [--quick] [--seed N] [--workdir DIR] [--rollout.engine {hf,vllm}]
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from rlhf_cli import api
from rlhf_core import plugins
from rlhf_core.config import MODES
from rlhf_core.config_parser import build_argparser, config_to_yaml, parse_config
from rlhf_core.errors import UserError, find_user_error

USAGE = __doc__.split("\n", 2)[2]


def fail(mode: str, exc: Exception, debug: bool, code: int, log: Path | None = None) -> int:
    """Print the message of the user error behind ``exc`` alone (the traceback went to the run's log, and goes
    to the terminal on ``--debug``); returns ``code``."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"rlhf train {mode}: {find_user_error(exc) or exc}", file=sys.stderr)
    if log is not None and not debug:
        print(f"(the traceback is in {log}; --debug prints it)", file=sys.stderr)
    return code


def cmd_train(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES:
        print(f"usage: rlhf train {{{','.join(MODES)}}} [flags] [--dry-run] [--debug]", file=sys.stderr)
        return 2
    mode, rest = argv[0], argv[1:]
    if "-h" in rest or "--help" in rest:
        build_argparser(mode).print_help()
        print(
            "\n  --config FILE        YAML file with any of the options above (repeatable)"
            "\n  --dry-run            print the resolved config and placement plan, start nothing"
            "\n  --debug              print the traceback of an error, not only its message"
        )
        return 0
    dry_run, debug = "--dry-run" in rest, "--debug" in rest
    rest = [a for a in rest if a not in ("--dry-run", "--debug")]
    try:
        cfg, notes = parse_config(mode, rest)
        asm = api.check(mode, cfg, notes)
    except UserError as exc:
        return fail(mode, exc, debug, 2)
    if dry_run:
        print(f"# rlhf train {mode} --dry-run: resolved configuration (nothing was started)")
        print(config_to_yaml(cfg, mode), end="")
        print("# " + asm.describe().replace("\n", "\n# "))
        return dry_run_resume(mode, cfg) if cfg.ckpt.load_enable else 0
    try:
        api.run(asm, debug=debug)
    except Exception as exc:
        if find_user_error(exc) is None:
            raise
        return fail(
            mode, exc, debug, 1, Path(cfg.ckpt.output_dir) / api.RUN_LOG
        )  # also when a Ray worker raised it
    return 0


def dry_run_resume(mode: str, cfg) -> int:
    """Say which checkpoint ``--ckpt.load_enable`` would resume from, or why none can be (exit 1)."""
    from rlhf_core.checkpoint import CheckpointError, resume_point

    root = Path(cfg.ckpt.path or Path(cfg.ckpt.output_dir) / "checkpoints")
    try:
        resume = resume_point(root)
    except CheckpointError as exc:
        print(f"rlhf train {mode}: {exc}", file=sys.stderr)
        return 1
    print(
        f"# --ckpt.load_enable: resumes from {resume}"
        if resume
        else f"# --ckpt.load_enable: no checkpoint under {root}; starts from scratch"
    )
    return 0


def cmd_plugins(argv: list[str]) -> int:
    try:
        info = plugins.describe(plugins.get_plugin_manager())
    except plugins.PluginError as exc:
        print(f"rlhf plugins: {exc}", file=sys.stderr)
        return 2
    if "--json" in argv:
        print(json.dumps(info, indent=2))
        return 0
    for dist in info:
        print(f"{dist['distribution']} {dist['version']}")
        if not dist["seams"]:
            print("  (registers nothing)")
        for seam, names in dist["seams"].items():
            print(f"  {seam:<22} {', '.join(sorted(names))}")
    return 0


# Imported when run: each pulls in packages (torch, transformers, fastapi) the other commands do not need.
MODULE_COMMANDS = {
    "generate": "rlhf_cli.generate",
    "chat": "rlhf_cli.chat",
    "serve-rm": "rlhf_agents.serve_rm",
    "serve-tinker": "rlhf_cli.tinker_service.server",
    "lora-merge": "rlhf_cli.lora_merge",
    "doctor": "rlhf_cli.doctor",
    "demo": "rlhf_cli.demo",
}
COMMANDS = {"train": cmd_train, "plugins": cmd_plugins}


EXIT_GRACE_S = 10.0  # how long the process may take to exit once the command has returned


def end_process_after(code: int, grace_s: float) -> None:
    """End this process with ``code`` at most ``grace_s`` seconds from now, also when threads that never end
    remain (user or plugin code that hangs: Python joins every non-daemon thread at exit, forever). Called
    once the command has returned: runs commit checkpoints atomically and have closed their metrics, so
    cutting the exit short loses nothing; a process that exits on its own in time never gets here."""

    def watchdog() -> None:
        time.sleep(grace_s)
        stuck = [t.name for t in threading.enumerate() if t not in (threading.main_thread(), watcher)]
        print(
            f"rlhf: thread(s) {', '.join(stuck) or '(none)'} still running {grace_s:g} s after the command "
            "ended (code that does not return); exiting without them",
            file=sys.stderr,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    watcher = threading.Thread(target=watchdog, name="rlhf-exit", daemon=True)
    watcher.start()


def main(argv: list[str] | None = None) -> int:
    """``rlhf ARGV``'s exit code. As the command itself (``argv`` None), the process then ends within
    EXIT_GRACE_S even if threads of code that hangs remain (docs/fault-handling.md, "Code that hangs")."""
    if argv is not None:
        return run_command(argv)
    code = 1  # a crash or Ctrl-C: Python prints its traceback as it exits
    try:
        code = run_command(sys.argv[1:])
        return code
    finally:
        end_process_after(code, EXIT_GRACE_S)


def run_command(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS | MODULE_COMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])
        print("usage:\n" + USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    if argv[0] in MODULE_COMMANDS:
        return importlib.import_module(MODULE_COMMANDS[argv[0]]).main(argv[1:]) or 0
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
