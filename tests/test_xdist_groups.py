"""The root conftest's fix for ``--dist loadgroup``: tests of one ``xdist_group`` run in one worker process
(the Ray tests share a Ray session and worker groups only within a process)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GROUPED = """
import os, time, pytest

pytestmark = pytest.mark.xdist_group("g")


@pytest.mark.parametrize("i", range(16))
def test_records_its_worker(i):
    time.sleep(0.3)  # long enough that, ungrouped, the second worker is up before the first has run them all
    with open(os.path.join(os.environ["RECORD_DIR"], f"{i}.worker"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])


def test_ungrouped_ones_still_spread():
    pass
"""


def run(tmp_path, *args) -> set[str]:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    record = tmp_path / "record"
    record.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "-p",
            "conftest",
            "--rootdir",
            str(tmp_path),
            "-c",
            "/dev/null",
            *args,
            str(tmp_path / "test_grouped.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "RECORD_DIR": str(record)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {p.read_text() for p in record.glob("*.worker")}


def test_one_group_runs_in_one_worker(tmp_path):
    assert len(run(tmp_path, "--dist", "loadgroup")) == 1


def test_without_loadgroup_the_tests_spread(tmp_path):
    # the check above could fail: plain load scheduling deals these tests to both workers
    assert run(tmp_path, "--dist", "load") == {"gw0", "gw1"}
