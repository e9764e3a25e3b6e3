"""Keys, tokens and passwords reach the code that uses them and nothing that shows or saves the config:
``--dry-run``, notes and errors, ``config.yaml``, ``run.json``, the W&B run config (tests/../test_rundir.py) and
reward-server messages (packages/rlhf-agents/tests/test_http_reward.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from rlhf_cli.assemble import assemble, write_run_dir
from rlhf_core.config import COMMANDS
from rlhf_core.config_parser import ConfigError, all_leaves, parse_config

KEY, PASSWORD, TOKEN = "sk-live-0123456789", "hunter2pw", "tok-9876"
URL = f"http://rm:{PASSWORD}@127.0.0.1:9/get_reward?token={TOKEN}"
# fields whose names look like secrets but hold dataset column names, a metric name or a PRM's step marker
NOT_SECRETS = {
    "input_key",
    "output_key",
    "label_key",
    "prompt_key",
    "chosen_key",
    "rejected_key",
    "label_kto_key",
    "image_key",
    "best_metric_key",
    "placeholder_token",
    "teacher_key",
}


@pytest.fixture
def wandb_site(tmp_path):
    """W&B is not installed here; the parser only checks that ``import wandb`` would work."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "wandb.py").write_text("# stand-in: the parser only checks that wandb can be imported\n")
    return site


def assert_hidden(text: str) -> None:
    for secret in (KEY, PASSWORD, TOKEN):
        assert secret not in text


def test_every_secret_looking_field_is_marked_secret():
    for mode in COMMANDS:
        for path, leaf in all_leaves(COMMANDS[mode]).items():
            name = path.rsplit(".", 1)[-1]
            if (
                re.search(r"(^|_)(key|token|password|passwd|secret|credentials?)$", name)
                and name not in NOT_SECRETS
            ):
                assert leaf.secret, f"--{path} looks like a secret: mark it option(secret=True)"


@pytest.mark.parametrize("mode", ["ppo", "sft"])
def test_dry_run_shows_neither_the_key_nor_url_credentials(mode, wandb_site, tmp_path, tiny_model):
    model = ["--pretrain", tiny_model]
    extra = ["--remote_rm_url", URL] if mode == "ppo" else ["--dataset", URL]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(wandb_site), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_cli.main",
            "train",
            mode,
            "--dry-run",
            *model,
            *extra,
            "--use_wandb",
            KEY,
            "--ckpt.output_dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert_hidden(out.stdout + out.stderr)
    assert "key: '***'" in out.stdout and "rm:***@127.0.0.1:9/get_reward?token=***" in out.stdout


def test_the_run_directory_hides_them_and_a_saved_config_cannot_be_reused_blindly(
    wandb_site, tmp_path, monkeypatch, tiny_model
):
    monkeypatch.syspath_prepend(str(wandb_site))
    cfg, _ = parse_config(
        "ppo",
        [
            "--pretrain",
            tiny_model,
            "--remote_rm_url",
            URL,
            "--use_wandb",
            KEY,
            "--ckpt.output_dir",
            str(tmp_path / "run"),
        ],
    )
    assert cfg.logger.wandb.key == KEY and cfg.reward.remote_url == URL  # the code gets the real values
    assert KEY not in repr(cfg)
    run = write_run_dir(assemble("ppo", cfg, gpus=False))
    for name in ("config.yaml", "run.json"):
        assert_hidden((run / name).read_text())
    with pytest.raises(
        ConfigError, match=r"--logger.wandb.key is '\*\*\*', the placeholder of a saved config"
    ):
        parse_config("ppo", ["--config", str(run / "config.yaml")])
    again, _ = parse_config("ppo", ["--config", str(run / "config.yaml"), "--logger.wandb.key", KEY])
    assert again.logger.wandb.key == KEY


def test_a_yaml_error_does_not_quote_the_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(f"logger:\n  wandb: {{key: {KEY}\n")  # unclosed mapping
    with pytest.raises(ConfigError) as err:
        parse_config("ppo", ["--config", str(f)])
    assert "not valid YAML at line" in str(err.value)
    assert_hidden(str(err.value))
