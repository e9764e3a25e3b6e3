"""keep_freed_memory: a step that reallocates what the previous step freed does not page-fault it in again."""

import ctypes.util
import json
import subprocess
import sys

import pytest

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


@pytest.mark.skipif(sys.platform != "linux" or "libc" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc malloc only")
def test_freed_memory_is_reused_without_page_faults():
    default, kept = step_faults("default"), step_faults("keep")
    # both fault the first step's memory in
    assert default[0] >= PAGES_PER_STEP * 0.9 and kept[0] >= PAGES_PER_STEP * 0.9
    # kept: the next five steps together fault in under a third of one step (heap fragmentation);
    # by default glibc unmaps or trims them and step 2 faults them all in again (its mmap threshold only
    # catches up after a few steps)
    assert sum(kept[1:]) < PAGES_PER_STEP * 0.3, kept
    assert default[1] > PAGES_PER_STEP * 0.9, default
