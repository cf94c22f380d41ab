"""The embedded Ray head, with another head on the same host."""
import os
import time
from pathlib import Path

import pytest

from rlhf_core.runtime.cluster import LocalRayHead

PRINT_GCS = "python -c \"import ray; ray.init(address='auto'); print('GCS', ray.get_runtime_context().gcs_address)\""


@pytest.mark.integration
@pytest.mark.xdist_group("rl_more")  # shares that worker's session head
def test_a_job_runs_on_the_head_it_was_submitted_to(ray_head):
    """A head started later on the same host must not capture this head's jobs.  With Ray's shared
    /tmp/ray, the job supervisor gives the driver the address of the head started last (its
    ray_current_cluster file): the driver ran on the other head and died when that one stopped."""
    from ray.job_submission import JobSubmissionClient

    with LocalRayHead() as later:
        # `ray start` records its address (ray_current_cluster) just before it settles into --block
        deadline = time.time() + 60
        while "block forever" not in Path(later.log_file.name).read_text() and time.time() < deadline:
            time.sleep(0.5)
        client = JobSubmissionClient(ray_head)
        job = client.submit_job(entrypoint=PRINT_GCS)
        deadline = time.time() + 120
        while (status := client.get_job_status(job)) not in ("SUCCEEDED", "FAILED", "STOPPED") and time.time() < deadline:
            time.sleep(0.5)
        logs = client.get_job_logs(job)
        assert status == "SUCCEEDED", logs[-3000:]
        gcs = [line.split()[-1] for line in logs.splitlines() if line.startswith("GCS ")]
        assert gcs and not gcs[0].endswith(f":{later.gcs_port}"), (gcs, later.gcs_port)
        temp_dir = later.temp_dir
    assert not os.path.exists(temp_dir)  # stop() removes the head's session files
