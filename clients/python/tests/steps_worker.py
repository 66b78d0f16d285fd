"""A worker process for the tests: each job is `payload.steps` steps of
`payload.stepSeconds` seconds, resumed from the checkpoint {"step": n}, saving one after
each step. Prints every client event as a JSON line on stdout.

Usage: steps_worker.py SIDECAR_URL ON_SHUTDOWN [--max-jobs N] [--concurrency N] [--async]
"""

import argparse
import asyncio
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


async def handle_async(job):
    step = (job.checkpoint or {}).get("step", 0)
    emit(leasehold.Event("started", job.name, job.attempt, message="from step %d" % step))
    while step < job.payload["steps"]:
        await asyncio.sleep(job.payload["stepSeconds"])
        job.check()
        step += 1
        job.save({"step": step})
    return {"steps": step, "attempt": job.attempt}


if __name__ == "__main__":
    leasehold.worker.main_logging()
    args = argparse.ArgumentParser()
    args.add_argument("sidecar")
    args.add_argument("on_shutdown")
    args.add_argument("--max-jobs", type=int, default=0)
    args.add_argument("--concurrency", type=int, default=1)
    args.add_argument("--async", dest="use_async", action="store_true")
    opts = args.parse_args()
    client = leasehold.Client(opts.sidecar, on_event=emit)
    leasehold.run(
        handle_async if opts.use_async else handle,
        client=client,
        wait=5,
        on_shutdown=opts.on_shutdown,
        max_jobs=opts.max_jobs,
        concurrency=opts.concurrency,
    )
