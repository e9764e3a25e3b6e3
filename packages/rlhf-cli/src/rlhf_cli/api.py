"""The Python API: a run built from Python objects, checked, run, and its directory and metrics returned
(:func:`train`; the README's "Python API" section). ``rlhf train`` is a thin layer over it (its README).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli.assemble import Assembly, assemble, write_run_dir
from rlhf_core import console, plugins
from rlhf_core.config import MODES, RL_MODES
from rlhf_core.config_parser import ConfigError, dict_tokens, parse_config
from rlhf_core.errors import find_user_error

RUN_LOG = "train.log"


@dataclass
class RunResult:
    output_dir: Path
    """The run directory: ``config.yaml``, ``run.json``, ``train.log``, ``metrics.jsonl``, ``checkpoints/``,
    ``model/``, and ``data/`` with the rows of ``dataset=`` / ``eval_dataset=``."""
    metrics: list[dict]
    """The rows of ``metrics.jsonl``, one per logged step (``step``, then the metrics by name); empty after a
    dry run. A resumed run's rows continue those of the steps it kept."""
    config: Any
    """The resolved config the run used (a dry run: would use)."""
    plan: str
    """Plugins, precision, ZeRO stage and placement, as ``--dry-run`` prints them."""


def train(
    mode: str,
    config: Any = None,
    *,
    reward_func: Any = None,
    dataset: Iterable[dict] | None = None,
    eval_dataset: Iterable[dict] | None = None,
    dry_run: bool = False,
    debug: bool = False,
    **overrides: Any,
) -> RunResult:
    """Run ``rlhf train <mode>`` from Python; returns when the run has ended (the README's "Python API").

    ``config``: a config object of the mode (``rlhf_core.config.MODES[mode]``), a dict of sections, a YAML
    file path, or None for the defaults; ``overrides``: sections over it, named as the flags are
    (``rollout={"batch_size": 8}`` is ``--rollout.batch_size 8``). ``reward_func``: ``ppo``'s reward, called
    as a reward file's ``reward_func`` (sync or ``async def``). ``dataset`` / ``eval_dataset``: rows (dicts,
    or a ``datasets.Dataset``) written into the run directory. ``dry_run``: check and plan only. ``debug``:
    third-party output on the terminal too, not only in ``train.log``. A mistake raises a
    :class:`rlhf_core.errors.UserError` naming the field, file or argument, before anything starts.
    """
    cfg, notes = parse(mode, config, overrides, reward_func)
    files = _data_files(mode, cfg, dataset, eval_dataset)
    asm = check(mode, cfg, notes)
    out = Path(cfg.ckpt.output_dir)
    if not dry_run:
        run(asm, files, debug)
    from rlhf_cli.report import read_metrics

    metrics = read_metrics(out / "metrics.jsonl") if not dry_run and (out / "metrics.jsonl").is_file() else []
    return RunResult(out, metrics, cfg, asm.describe())


def parse(mode: str, config: Any, overrides: dict[str, Any], reward_func: Any) -> tuple[Any, list[str]]:
    """The config of :func:`train`'s arguments, and the notes of parsing it."""
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; modes are: {', '.join(MODES)}")
    cfg, notes = parse_config(
        mode,
        _config_flags(mode, config) + dict_tokens(overrides, none_is_default=False),
        config if type(config) is MODES[mode] else None,
    )
    if reward_func is not None:
        if mode not in RL_MODES:
            raise ConfigError(f"reward_func= is the reward of 'rlhf train ppo'; rlhf train {mode} takes none")
        cfg.reward.func = reward_func
    return cfg, notes


def _config_flags(mode: str, config: Any) -> list[str]:
    """The flags ``train``'s ``config=`` stands for (none for a config object, which is the base instead)."""
    if config is None or type(config) is MODES[mode]:
        return []
    if isinstance(config, (str, os.PathLike)):
        return ["--config", str(config)]
    if isinstance(config, dict):
        return dict_tokens(config)
    raise ConfigError(
        f"config= is a {type(config).__name__}: rlhf train {mode} takes a {MODES[mode].__name__}, "
        "a dict of sections or a YAML file path"
    )


def _data_files(mode: str, cfg: Any, dataset: Any, eval_dataset: Any) -> dict[Path, str]:
    """``dataset=`` and ``eval_dataset=`` as JSON-lines files of the run directory, which ``cfg`` then names: the
    run, its resume and a later ``rlhf train --config <run>/config.yaml`` read the same rows."""
    data_dir = Path(cfg.ckpt.output_dir).resolve() / "data"
    files = {}
    for arg, rows, section, key in (
        ("dataset", dataset, "data", "prompt_dataset" if mode in RL_MODES else "dataset"),
        ("eval_dataset", eval_dataset, "eval", "dataset"),
    ):
        if rows is None:
            continue
        if getattr(getattr(cfg, section), key):
            raise ConfigError(f"{arg}= and --{section}.{key} both give the data: give one")
        path = data_dir / f"{arg}.jsonl"
        files[path] = "".join(_json_line(row, arg, i) for i, row in enumerate(rows))
        if cfg.ckpt.load_enable and path.is_file() and path.read_text() != files[path]:
            raise ConfigError(
                f"{arg}=: the rows differ from {path}, which the run being resumed read: resuming "
                "on other data would not continue it"
            )
        setattr(getattr(cfg, section), key, [str(path)])
    return files


def _json_line(row: Any, arg: str, i: int) -> str:
    if not isinstance(row, dict):
        raise ConfigError(
            f"{arg}= row {i} is a {type(row).__name__}; expected a dict (give a list of dicts or a "
            "datasets.Dataset)"
        )
    try:
        return json.dumps(row) + "\n"
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{arg}= row {i} cannot be written as JSON: {exc}") from None


def check(mode: str, cfg: Any, notes: Iterable[str]) -> Assembly:
    """Resolve the plugins, check everything the driver can and plan the placement (what ``--dry-run`` shows);
    print the notes of the config and of the plan. Starts nothing and writes nothing."""
    asm = assemble(mode, cfg)
    for note in [*notes, *asm.notes]:
        print(f"note: {note}", file=sys.stderr)
    return asm


def run(asm: Assembly, files: dict[Path, str] | None = None, debug: bool = False) -> Path:
    """Make the run directory (with ``files``) and run the checked ``asm``; returns the directory. An error that
    ends the run is raised after its traceback went to the run's log (:func:`run_log`)."""
    out = write_run_dir(asm, files)
    with run_log(out, debug) as log:
        try:
            if asm.mode in RL_MODES:
                from rlhf_cli.rl.run import run_rl

                run_rl(asm)
            else:
                if not asm.single_process:  # Ray starts as for an RL run, with its reaper
                    from rlhf_cli.ray_launch import init_ray

                    init_ray(asm.cfg)
                plugins.resolve(
                    plugins.get_plugin_manager(), "train_backends", asm.cfg.train.backend
                ).run_trainer(asm.mode, asm.cfg)
        except Exception as exc:
            # the whole traceback goes to the log, also for a user mistake: a bug report needs it
            user_error = find_user_error(exc)
            title = f"stopped: {user_error}" if user_error is not None else "crashed"
            with log.open("a") as f:  # the log file only (logging would reach the terminal too)
                f.write(f"rlhf train {asm.mode} {title}\n{''.join(traceback.format_exception(exc))}")
            raise
    return out


@contextlib.contextmanager
def run_log(out: Path, debug: bool) -> Iterator[Path]:
    """``out/train.log`` receives this process's log records (INFO and up) while the run lasts; the terminal
    keeps warnings and errors, and third-party output only with ``debug`` (:mod:`rlhf_core.console`)."""
    root = logging.getLogger()
    handlers = [logging.FileHandler(out / RUN_LOG)]
    handlers[0].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not root.handlers:  # what logging's last-resort handler did: warnings and errors on stderr
        handlers.append(logging.StreamHandler(sys.stderr))
        handlers[1].setLevel(logging.WARNING)
        if not debug:
            handlers[1].addFilter(console.OwnRecords())
    env = {console.RUN_LOG_ENV: str((out / RUN_LOG).resolve()), console.DEBUG_ENV: "1" if debug else "0"}
    if not debug:
        env.update(console.QUIET_ENV)
        console.library_loggers_to_root()
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    level = root.level
    root.setLevel(logging.INFO)
    for h in handlers:
        root.addHandler(h)
    try:
        yield out / RUN_LOG
    finally:
        root.setLevel(level)
        for h in handlers:
            root.removeHandler(h)
            h.close()
        if not debug:
            from transformers.utils import logging as hf_logging

            hf_logging.enable_progress_bar()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
