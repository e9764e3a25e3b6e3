"""A quiet console: third-party output of a run goes to its ``train.log`` (``RLHF_RUN_LOG``), and to the
terminal too only with ``--debug`` (``RLHF_DEBUG=1``); rlhf's own goes to the terminal (rlhf-cli's README).
In the driver's process (a single-process run included) third-party loggers reach the root logger, whose
terminal handler shows only rlhf's records (:class:`OwnRecords`); third-party bars are off there, not logged
(``TQDM_DISABLE`` is a bar's default, so rlhf's bar, which sets it, stays). A Ray worker
(:func:`setup_ray_worker`) writes its stdout and stderr, file descriptors included, to the log file; rlhf's
warnings still reach the terminal.
"""

from __future__ import annotations

import logging
import os
import sys

RUN_LOG_ENV = "RLHF_RUN_LOG"
DEBUG_ENV = "RLHF_DEBUG"
OWN_LOGGERS = ("rlhf_", "__main__")  # rlhf_core, rlhf_cli, rlhf_agents, ... and a user's script


class OwnRecords(logging.Filter):
    """Lets through rlhf's records and the root logger's (``logging.warning(...)``), not third-party ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "root" or record.name.startswith(OWN_LOGGERS)


def library_loggers_to_root() -> None:
    """transformers' and DeepSpeed's loggers write to their own terminal handlers; make them use the root's.
    (vLLM's does too unless ``VLLM_CONFIGURE_LOGGING=0``, which the run sets before vLLM is imported.)
    transformers' bars are turned off: they set ``disable`` themselves, so ``TQDM_DISABLE`` misses them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
    for name in ("DeepSpeed", "vllm"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


QUIET_ENV = {"VLLM_CONFIGURE_LOGGING": "0", "TQDM_DISABLE": "1"}
"""What keeps third-party output off the terminal of the driver's process (Ray workers inherit it)."""


def setup_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` for a run's workers: stdout and stderr to the run's log file (unless
    ``--debug``), rlhf's warnings to the terminal (Ray forwards the worker's original stderr to the driver)."""
    path = os.environ.get(RUN_LOG_ENV)
    if not path or not os.path.isdir(os.path.dirname(path)):  # another node, without the run's directory
        return
    os.environ.pop("TQDM_DISABLE", None)  # in the log file the bars cost nothing
    if os.environ.get(DEBUG_ENV) == "1":
        return
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        stream.flush()
        os.dup2(log_fd, fd)
    os.close(log_fd)
    root.addHandler(
        logging.StreamHandler(sys.stderr)
    )  # now the log file: vLLM's records, which reach the root
    handler = logging.StreamHandler(terminal)
    handler.setLevel(logging.WARNING)
    handler.addFilter(OwnRecords())
    root.addHandler(handler)
