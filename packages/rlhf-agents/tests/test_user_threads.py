"""Sync user code (reward functions, environment calls) runs in daemon threads of its own: one that never
returns is given up on at its timeout and does not keep the process from exiting; at most USER_THREADS run
at once per event loop, as with asyncio's default pool."""

import asyncio
import subprocess
import sys
import threading
import time

from rlhf_agents.executors import USER_THREADS, call_user

HANG_THEN_EXIT = """
import asyncio, time
from rlhf_agents.executors import call_user
async def main():
    try:
        await asyncio.wait_for(call_user(time.sleep, 10**6), 0.2)
    except asyncio.TimeoutError:
        print("given up")
asyncio.run(main())
"""


def test_a_call_that_never_returns_is_given_up_on_and_the_process_exits():
    done = subprocess.run([sys.executable, "-c", HANG_THEN_EXIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "given up", done.stderr[-2000:]


def test_at_most_user_threads_run_at_once_and_results_and_errors_come_back():
    lock, running, peak = threading.Lock(), [0], [0]

    def work(x):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        if x == 7:
            raise ValueError("seven")
        return 2 * x

    async def calls():
        return await asyncio.gather(
            *(call_user(work, i) for i in range(3 * USER_THREADS)), return_exceptions=True
        )

    results = asyncio.run(calls())
    assert [r for r in results if not isinstance(r, ValueError)] == [
        2 * i for i in range(3 * USER_THREADS) if i != 7
    ]
    assert str(results[7]) == "seven" and peak[0] == USER_THREADS
