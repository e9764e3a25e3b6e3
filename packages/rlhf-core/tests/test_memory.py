"""keep_freed_memory: a step that reallocates what the previous step freed does not page-fault it in again.
release_file_pages: a clean weight file's pages leave the process's resident memory and read back the same.
release_free_heap: the heap pages that keep_freed_memory keeps leave, and what is still in use stays."""

import ctypes.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlhf_core.memory import release_file_pages

# Six "steps", each allocating and freeing 24 touched tensors of 1-4 MiB (15360 pages in all); prints the
# minor page faults of each step.
STEPS = """
import json, resource, sys, torch
if sys.argv[1] == "keep":
    from rlhf_core.memory import keep_freed_memory
    assert keep_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones((k % 4 + 1) << 18) for k in range(24)]
    del xs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
PAGES_PER_STEP = 15360


def step_faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    sys.platform != "linux" or "libc" not in (ctypes.util.find_library("c") or ""), reason="glibc malloc only"
)
def test_freed_memory_is_reused_without_page_faults():
    default, kept = step_faults("default"), step_faults("keep")
    # both fault the first step's memory in
    assert default[0] >= PAGES_PER_STEP * 0.9 and kept[0] >= PAGES_PER_STEP * 0.9
    # kept: the next five steps together fault in under a third of one step (heap fragmentation);
    # by default glibc unmaps or trims them and step 2 faults them all in again (its mmap threshold only
    # catches up after a few steps)
    assert sum(kept[1:]) < PAGES_PER_STEP * 0.3, kept
    assert default[1] > PAGES_PER_STEP * 0.9, default


# Keeps freed memory, frees 96 of 128 touched 1 MiB tensors (heap blocks, under the 32 MiB mmap threshold),
# releases the free heap; prints RssAnon (MiB) after the frees and after the release, and the kept tensors' sum.
RELEASE = """
import json, torch
from rlhf_core.memory import keep_freed_memory, release_free_heap
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) >> 10
assert keep_freed_memory()
xs = [torch.full((1 << 18,), float(k)) for k in range(128)]
kept = xs[::4]
del xs
freed = anon()
assert release_free_heap()
print(json.dumps([freed, anon(), float(sum(x.sum() for x in kept))]))
"""


@pytest.mark.skipif(
    sys.platform != "linux" or "libc" not in (ctypes.util.find_library("c") or ""), reason="glibc malloc only"
)
def test_release_free_heap_hands_back_the_free_pages_only():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True)
    freed, released, total = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        released <= freed - 80
    )  # 96 MiB freed: most of it leaves (chunk headers keep a page here and there)
    assert total == sum(float(k) * (1 << 18) for k in range(0, 128, 4))  # the 32 kept read back intact


def rss_file_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) >> 10


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps and madvise")
def test_release_file_pages_drops_clean_weight_mappings_only(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1 << 22), "v": torch.randn(1 << 20)}, path)  # 16 + 4 MiB
    with safe_open(path, "pt") as f:  # mapped from the file, as transformers loads a checkpoint
        w, v = f.get_tensor("w"), f.get_tensor("v")
    copies = w.clone(), v.clone()
    assert float(w.sum() + v.sum()) == pytest.approx(float(copies[0].sum() + copies[1].sum()))  # pages in
    before = rss_file_mib()
    assert release_file_pages([w, v]) >= 20 << 20
    assert rss_file_mib() <= before - 16
    assert torch.equal(w, copies[0]) and torch.equal(v, copies[1])  # read back from the file
    w[0] = 123.0  # a copied-on-write page: the mapping now holds data the file does not
    assert release_file_pages([w, v]) == 0
    assert w[0] == 123.0 and torch.equal(w[1:], copies[0][1:])
    heap = torch.ones(1 << 22)
    assert release_file_pages([heap]) == 0 and heap.sum() == 1 << 22
