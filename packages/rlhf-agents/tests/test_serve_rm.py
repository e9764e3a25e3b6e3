"""``rlhf serve-rm`` as a real process (``python -m rlhf_agents.serve_rm``), hit over HTTP."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from rlhf_agents.reward_model import RewardModelScorer
from rlhf_agents.serve_rm import check_bind

API_KEY = "test-key-123"
QUERIES = ["w10 w11 w12 w13 w14", "w20 w21", "w30 w31 w32 w33 w34 w35 w36 w37"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tiny_dir) -> Path:
    """A reward model: the tiny Llama with a seeded value head ``score``, saved as one checkpoint."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_rm")
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(tiny_dir), num_labels=1, dtype=torch.float32
    )
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tiny_dir)).save_pretrained(str(out))
    return out


class Server:
    """A serve-rm process; its output is collected by a thread so the pipe never fills up."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf_agents.serve_rm", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_listening(self, timeout: float = 90.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError("serve-rm exited:\n" + "".join(self.output)) from None
                continue
            if "listening on http://" in line:
                return line.split("listening on ")[1].split()[0]
        raise TimeoutError("serve-rm did not start:\n" + "".join(self.output))

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        time.sleep(0.1)
        return "".join(self.output)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """Status and JSON answer; an answer that is not JSON (a bare 500) comes back as ``{"text": ...}``."""
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"text": raw.decode(errors="replace")}


def listening_address(port: int) -> str:
    """The local address of the socket listening on ``port`` (from /proc/net/tcp), e.g. ``127.0.0.1``."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            return ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    raise LookupError(port)


@pytest.fixture(scope="module")
def server(rm_dir):
    srv = Server(
        [
            "--reward.model_name_or_path",
            str(rm_dir),
            "--port",
            "0",
            "--ds.param_dtype",
            "fp32",
            "--batch_size",
            "2",
            "--max_len",
            "64",
            "--max_body_bytes",
            "262144",
            "--max_batch",
            "8",
        ],
        env={"RLHF_RM_API_KEY": API_KEY},
    )
    base = srv.wait_listening()
    yield srv, base
    srv.stop()


@pytest.mark.slow
def test_scores_match_an_unpadded_forward_and_queries_are_not_logged(server, rm_dir):
    from transformers import AutoModelForSequenceClassification

    srv, base = server
    body = json.dumps({"query": QUERIES, "prompts": ["a", "b", "c"], "labels": [1, 2, 3]}).encode()
    status, answer = post(f"{base}/get_reward", body, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, answer
    assert answer["scores"] == answer["rewards"] and answer["extra_logs"] == {}
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), num_labels=1, dtype=torch.float32)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(rm_dir))
    for query, got in zip(QUERIES, answer["rewards"]):
        ids = tok.encode(query, add_special_tokens=False)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, 0].item()  # one sequence, no padding
        assert abs(got - want) < 1e-4
    with urllib.request.urlopen(f"{base}/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
    with urllib.request.urlopen(f"{base}/openapi.json", timeout=10) as resp:
        assert "/get_reward" in json.loads(resp.read())["paths"]
    assert "w30 w31" not in "".join(srv.output)


@pytest.mark.slow
def test_rejects_missing_key_big_bodies_bad_json_and_big_batches(server):
    _, base = server
    url, auth = f"{base}/get_reward", {"Authorization": f"Bearer {API_KEY}"}
    ok_body = json.dumps({"query": ["w1"]}).encode()
    assert post(url, ok_body)[0] == 401
    assert post(url, ok_body, {"Authorization": "Bearer wrong"})[0] == 401
    status, answer = post(url, json.dumps({"query": ["w1 " * 100_000]}).encode(), auth)
    assert status == 413 and "262144" in answer["detail"]
    status, answer = post(url, b'{"query": ["w1",', auth)
    assert status == 400 and "not valid JSON" in answer["detail"]
    assert post(url, json.dumps({"query": "w1"}).encode(), auth)[0] == 400
    assert post(url, json.dumps({"query": [""]}).encode(), auth)[0] == 400
    status, answer = post(url, json.dumps({"query": ["w1"] * 9}).encode(), auth)
    assert status == 422 and "limit is 8" in answer["detail"]


HOSTILE = [  # (body, the reason the 400 must give)
    (json.dumps({"query": ["w1 \ud800 w2"]}).encode(), "lone surrogate \\ud800 at character 3"),
    (json.dumps({"query": ["w1", "\udfff"]}).encode(), "query[1] is not valid Unicode"),
    (b"[" * 100_000, "nests JSON arrays or objects too deeply"),
    (b'{"query": ["w1"], "labels": ' + b'{"a":' * 20_000, "too deeply"),
    (b'{"query": ["w1 \xff"]}', "not UTF-8 text: byte 0xff at offset 15"),
    (b'{"query": ["\xed\xa0\x80"]}', "not UTF-8"),  # a surrogate encoded as UTF-8 bytes (CESU-8)
    (b"\xff\xfe{\x00}\x00", "not UTF-8"),  # UTF-16 with a byte-order mark
    (b'{"query": ["w1"], "labels": [' + b"9" * 5000 + b"]}", "number that cannot be read"),
    (b"", "not valid JSON"),
    (b'{"query": ["w1"]', "not valid JSON"),
    (b'"w1"', "must be a JSON object"),
    (b'[{"query": ["w1"]}]', "must be a JSON object"),
    (b'{"query": NaN}', "'query' must be a list"),
    (b'{"query": [NaN]}', "query[0] must be a non-empty string"),
    (b'{"query": [1e999999]}', "query[0] must be a non-empty string"),
    (b'{"query": null}', "'query' must be a list"),
    (b'{"query": {"0": "w1"}}', "'query' must be a list"),
    (b'{"query": ["w1", 7]}', "query[1] must be a non-empty string"),
    (b'{"query": [["w1"]]}', "query[0] must be a non-empty string"),
    (b'{"query": ["w1"], "prompts": "w1"}', "'prompts' must be a list as long as 'query'"),
    (b'{"query": ["w1"], "labels": [1, 2]}', "'labels' must be a list as long as 'query'"),
]


@pytest.mark.slow
def test_every_unreadable_body_is_a_400_with_its_reason_and_the_server_stays_up(server):
    _, base = server
    url, auth = f"{base}/get_reward", {"Authorization": f"Bearer {API_KEY}"}
    good = json.dumps({"query": QUERIES}).encode()
    status, before = post(url, good, auth)
    assert status == 200
    for body, reason in HOSTILE:
        status, answer = post(url, body, auth)
        assert (status, reason in answer.get("detail", "")) == (400, True), (body[:60], status, answer)
    # bodies it can read, whatever is in the fields it does not use: NaN, huge floats, deep-ish nesting
    for body in (
        b'{"query": ["w1"], "labels": [NaN], "prompts": [Infinity]}',
        b'{"query": ["w1"], "labels": [1e999999]}',
        b'{"query": ["w1"], "labels": [' + b"[" * 200 + b"]" * 200 + b"]}",
    ):
        status, answer = post(url, body, auth)
        assert status == 200 and len(answer["rewards"]) == 1, (body[:60], status, answer)
    with urllib.request.urlopen(f"{base}/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
    assert post(url, good, auth) == (200, before)


@pytest.mark.slow
def test_binds_to_loopback_by_default(server):
    _, base = server
    host, port = base.removeprefix("http://").split(":")
    assert host == "127.0.0.1"
    assert listening_address(int(port)) == "127.0.0.1"


def test_refuses_other_interfaces_without_an_api_key(rm_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_agents.serve_rm",
            "--reward.model_name_or_path",
            str(rm_dir),
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "RLHF_RM_API_KEY"},
    )
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0 without an API key" in proc.stderr


def test_bind_rules():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert check_bind(host, None, False) is None
    assert "refusing to listen on 0.0.0.0" in check_bind("0.0.0.0", None, False)
    assert "refusing to listen on 10.1.2.3" in check_bind("10.1.2.3", None, False)
    assert check_bind("0.0.0.0", "key", False) is None
    assert check_bind("0.0.0.0", None, True) is None


def test_normalisation_uses_the_mean_and_std_stored_in_the_config(rm_dir, tmp_path):
    from transformers import AutoConfig

    plain = RewardModelScorer(str(rm_dir), dtype="fp32")
    stored = tmp_path / "rm_with_stats"
    plain.model.config.mean, plain.model.config.std = 0.25, 2.0
    plain.model.save_pretrained(str(stored))
    plain.tokenizer.save_pretrained(str(stored))
    assert AutoConfig.from_pretrained(str(stored)).mean == 0.25
    normalised = RewardModelScorer(str(stored), dtype="fp32", normalize=True)
    raw = plain.score_texts(QUERIES)
    assert normalised.score_texts(QUERIES) == pytest.approx([(r - 0.25) / 2.0 for r in raw], abs=1e-5)
