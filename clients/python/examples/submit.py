"""Submit a job from code and wait for its result: the README's "Submit jobs from code".

Usage: python submit.py QUEUE AUDIO_URL ORDER_ID [NAMESPACE]

Prints the worker's result as JSON and exits 0; on a failed or cancelled job prints every
failed attempt and exits 1. Run it twice with the same ORDER_ID: the second run finds the job
the first one submitted (the idempotency key), and prints the same result.
"""

import json
import sys

import leasehold


def main(queue: str, audio: str, order: str, namespace: str = None) -> int:
    jobs = leasehold.Producer(namespace)  # kubeconfig, then in-cluster; its namespace
    job = jobs.submit(
        queue,
        {"audio": audio},
        key="order-%s" % order,  # idempotency key: the same key, the same job
        priority=5,
        max_attempts=3,
        concurrency_key="acme",
    )
    print("%s %s" % ("submitted" if job.created else "already submitted:", job.name), file=sys.stderr)
    try:
        result = jobs.wait(job.name, timeout=3600)  # await jobs.wait_async(...) in async code
    except leasehold.JobFailed as failed:  # JobCancelled too; WaitTimeout on timeout
        print(failed.reason, file=sys.stderr)
        for f in failed.failures:  # every failed attempt: reason, message, holder
            print("  attempt %(attempt)s on %(holder)s: %(reason)s: %(message)s" % f, file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
