"""An example handler: makes a thumbnail of each image of the payload, checkpointing the
index of the next one, so that a later attempt resumes where this one stopped.

The payload is ``{"images": [url, ...]}``; the result ``{"thumbnails": n}``. A rate-limited
image store makes the attempt fail as retryable, with the store's own delay; on the job's
last attempt the handler says so in the failure's message.
"""

import leasehold


class RateLimited(Exception):
    def __init__(self, retry_after):
        Exception.__init__(self, "rate limited for %s s" % retry_after)
        self.retry_after = retry_after


def make_thumbnail(url):
    """Stands in for the real work (fetch, resize, upload)."""
    if url.startswith("limited:"):
        raise RateLimited(retry_after=float(url.split(":")[1]))
    return url + ".thumb.png"


def handle(job):
    images = job.payload["images"]
    start = job.checkpoint or 0  # resume where the last attempt stopped
    for i in range(start, len(images)):
        try:
            make_thumbnail(images[i])
        except RateLimited as err:
            last = " (last attempt: the job now fails)" if job.last_attempt else ""
            raise leasehold.Fail("RateLimited", "image %d: %s%s" % (i, err, last), True, err.retry_after)
        job.save(i + 1)  # sent with the next heartbeat
        job.progress((i + 1) / len(images), "image %d of %d" % (i + 1, len(images)))
        job.sleep(0.1)  # raises once the lease is lost or the job cancelled
    return {"thumbnails": len(images) - start}


if __name__ == "__main__":
    leasehold.run(handle)
