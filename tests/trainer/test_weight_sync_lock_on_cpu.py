"""Weight syncs of two runs with the same Ray job id take turns on one host; other job ids never wait."""

from __future__ import annotations

import os
import threading
import time
import uuid

from beyond_agent.weights.host_lock import lock_path, weight_sync_lock


def test_a_second_sync_of_the_same_job_id_waits_until_the_first_ends():
    job_id = f"test{uuid.uuid4().hex[:8]}"
    events, said = [], []
    first_holds = threading.Event()

    def first():
        with weight_sync_lock(job_id, said.append):
            first_holds.set()
            time.sleep(0.5)
            events.append("first ends")

    def second():
        first_holds.wait(5)
        with weight_sync_lock(job_id, said.append) as waited:
            events.append(f"second starts after {waited:.1f} s")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert events[0] == "first ends" and events[1].startswith("second starts after")
    assert float(events[1].split()[3]) >= 0.3
    assert len(said) == 1 and f"Ray job {job_id} too" in said[0]
    with weight_sync_lock(f"{job_id}x", said.append) as waited:  # another job id: no wait, nothing said
        assert waited < 0.1
    assert len(said) == 1
    for name in (job_id, f"{job_id}x"):
        os.unlink(lock_path(name))
