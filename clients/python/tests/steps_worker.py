"""A worker process for the tests: each job is `payload.steps` steps of
`payload.stepSeconds` seconds, resumed from the checkpoint {"step": n}, saving one after
each step. Prints every client event as a JSON line on stdout.

Usage: steps_worker.py SIDECAR_URL ON_SHUTDOWN [--max-jobs N]
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import leasehold  # noqa: E402


def emit(event):
    fields = {k: v for k, v in vars(event).items() if v is not None}
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def handle(job):
    step = (job.checkpoint or {}).get("step", 0)
    emit(leasehold.Event("started", job.name, job.attempt, message="from step %d" % step))
    while step < job.payload["steps"]:
        job.sleep(job.payload["stepSeconds"])
        step += 1
        job.save({"step": step})
    return {"steps": step, "attempt": job.attempt}


if __name__ == "__main__":
    leasehold.worker.main_logging()
    max_jobs = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--max-jobs" else 0
    client = leasehold.Client(sys.argv[1], on_event=emit)
    leasehold.run(handle, client=client, wait=5, on_shutdown=sys.argv[2], max_jobs=max_jobs)
