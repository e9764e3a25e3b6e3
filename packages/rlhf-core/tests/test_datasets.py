"""Datasets by name, as OpenRLHF takes them: local dataset directories (``save_to_disk`` or data files, ``dir@sub``)
and Hugging Face hub names (``name``, ``name@data_dir``) loaded with ``datasets.load_dataset``. There is no
network here: the hub tests fill the offline cache with ``datasets``' own builder and load from it with
``HF_HUB_OFFLINE=1``, in a fresh process (``datasets`` reads these variables when imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlhf_core.data import DataError, read_rows

ROWS = [{"input": f"w{i}", "label": str(i)} for i in range(4)]


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_local_directories_saved_or_of_data_files_and_their_subdirectories(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))  # a Dataset: no splits
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    ).save_to_disk(str(tmp_path / "repo" / "main"))
    write_jsonl(tmp_path / "plain" / "prompts.jsonl", ROWS)  # no split in the file name: all of it is train
    write_jsonl(tmp_path / "repo" / "other" / "train-00000.jsonl", ROWS[1:])
    assert [r.data for r in read_rows(tmp_path / "saved")] == ROWS
    assert [r.data for r in read_rows(tmp_path / "plain")] == ROWS
    assert read_rows(tmp_path / "plain")[2].where() == f"{tmp_path / 'plain' / 'prompts.jsonl'} row 2"
    assert [r.data for r in read_rows(f"{tmp_path / 'repo'}@main", "test")] == ROWS[2:]
    assert [r.data for r in read_rows(f"{tmp_path / 'repo'}@other")] == ROWS[1:]
    with pytest.raises(DataError, match=r"repo@nope \(no directory 'nope' in"):
        read_rows(f"{tmp_path / 'repo'}@nope")
    with pytest.raises(DataError, match=r"dataset not found: .*missing.jsonl \(no such file"):
        read_rows(tmp_path / "missing.jsonl")  # a path, not a hub name: no hub lookup


HUB = textwrap.dedent("""
    import glob, json, shutil, sys
    from pathlib import Path
    from datasets.packaged_modules.json.json import Json
    from rlhf_core.data import DataError, read_rows

    cache, src = Path(sys.argv[1]), Path(sys.argv[2])

    def cache_as_hub(repo, config, files):
        # what a download of hub dataset `repo` leaves in the cache, written by datasets' own builder
        work = cache.parent / "build" / config
        Json(cache_dir=str(work), dataset_name=repo.split("/")[1], data_files=files).download_and_prepare()
        (built,) = glob.glob(f"{work}/*/*/*/")
        shutil.copytree(built, cache / repo.replace("/", "___") / config / "0.0.0" / "0123456789abcdef")

    cache_as_hub("acme/prompts", "default", {"train": str(src / "train.jsonl")})
    cache_as_hub("acme/prompts", "default-data_dir=main", {"train": str(src / "main.jsonl")})
    out = {"plain": [r.data for r in read_rows("acme/prompts")],
           "where": read_rows("acme/prompts")[1].where(),
           "main": [r.data for r in read_rows("acme/prompts@main")]}
    for name, split in (("acme/missing", "train"), ("acme/prompts", "test")):
        try:
            read_rows(name, split)
        except DataError as exc:
            out[name + ":" + split] = str(exc)
    print(json.dumps(out))
""")


def test_hub_names_load_from_the_offline_cache_or_fail_naming_the_dataset(tmp_path):
    write_jsonl(tmp_path / "src" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "src" / "main.jsonl", ROWS[::-1])
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    done = subprocess.run(
        [sys.executable, "-c", HUB, str(tmp_path / "cache"), str(tmp_path / "src")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["plain"] == ROWS and out["main"] == ROWS[::-1]
    assert out["where"] == "acme/prompts[train] row 1"
    missing = out["acme/missing:train"]
    assert "dataset 'acme/missing' is not a local file or directory" in missing
    assert (
        "offline mode: only datasets already in the cache load" in missing
        and str(tmp_path / "cache") in missing
    )
    assert out["acme/prompts:test"] == "dataset 'acme/prompts': no split 'test'; it has train"
