#!/usr/bin/env python3
"""Example leasehold worker, on the Python client (clients/python, package `leasehold`).

It claims jobs from the leasehold sidecar, does the work in chunks, saves a resumable
checkpoint after every chunk (the client sends it with its background heartbeats), and
completes or fails the job. Lease loss, cancellation and SIGTERM are the client's: see
clients/python/README.md. What is left here is the task.

Job payload:
    {"task": "wordcount" | "sha256" | "gzip",
     "file": "/usr/share/common-licenses/<NAME>",
     "chunkBytes": 4096,            # optional, 1..16777216
     "chunkDelaySeconds": 0.2}      # optional, 0..3600 (simulated slow work)

Checkpoint (saved after every chunk, handed back on a re-claim):
    {"v": 1, "task", "file", "chunkBytes", "fileSize", "offset": bytes_done,
     "state": {...task specific...}}
  wordcount: {"lines", "words", "bytes", "inWord"}; inWord carries a word that
             straddles a chunk boundary so it is counted exactly once.
             Words/lines/bytes agree with `LC_ALL=C wc`.
  sha256:    {"chunkDigests": [hex, ...]}; at the end the whole file is hashed
             again and checked against the chunk digests.
  gzip:      {"deflateBytes", "crc32", "chunks"}; every chunk is deflated on
             its own, primed with the preceding 32 KiB of the file as a preset
             dictionary and ended with a sync flush (the pigz scheme). The
             pieces concatenate into one valid gzip member, so the result is
             the exact size of a real .gz file, whichever workers did which
             chunks, and resuming needs only the offset and these numbers.
  A checkpoint that does not match the payload or the file (different task,
  file, chunkBytes or file size, or malformed state) is ignored: start fresh.

Stdout: one JSON object per line, flushed at once (the client's events):
    {"event":"claimed","name","attempt","resumeFrom"}
    {"event":"heartbeat","name","attempt","status","error","offset"}
    {"event":"complete","name","attempt","status","error"}
    {"event":"fail","name","attempt","status","error"}
    {"event":"release","name","attempt","status","error"}
    {"event":"lost","name","attempt"}
    {"event":"idle"}
    {"event":"error","message"}
"status" is the HTTP status, "error" the server's error code or null; "offset"
the checkpoint's offset the heartbeat carried (or the last one sent). Every
"claimed" is followed by exactly one outcome: a complete, fail or release event
with status 200, or a "lost" event. A call that got no answer is an "error"
event (no status); the client repeats it.
Narration for humans goes to stderr, prefixed with "[NAME]".
"""

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
import zlib

try:
    import leasehold
except ImportError:  # run from a checkout: the client beside it
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
    import leasehold

TASKS = ("gzip", "sha256", "wordcount")
CHECKPOINT_VERSION = 1
DEFAULT_CHUNK_BYTES = 4096
DEFAULT_CHUNK_DELAY = 0.2
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MAX_CHUNK_DELAY = 3600.0
DEFAULT_DATA_DIR = "/usr/share/common-licenses"
WHITESPACE = frozenset(b" \t\n\v\f\r")  # what bytes.split() and C-locale wc use
GZIP_LEVEL = 6
GZIP_WINDOW = 32 * 1024
GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # no name, no mtime, OS unknown
GZIP_TRAILER_BYTES = 8


class BadPayload(leasehold.Fail):
    """A payload no attempt can run: the job fails at once, not retried."""

    def __init__(self, message):
        leasehold.Fail.__init__(self, "BadPayload", message, False)


# --------------------------------------------------------------------------
# output


class Output:
    """The JSON event lines on stdout and the narration on stderr."""

    def __init__(self, name):
        self.name = name
        self.lock = threading.Lock()
        self.offsets = {}  # (job, attempt) -> offset of the last checkpoint sent
        self.completes = {}  # (job, attempt) -> complete calls sent (answered or not)

    def event(self, **fields):
        line = json.dumps(fields, separators=(",", ":"))
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def say(self, message):
        with self.lock:
            sys.stderr.write("[%s] %s\n" % (self.name, message))
            sys.stderr.flush()

    def on_event(self, e):
        """The client's events, in the format of the module docstring."""
        if e.kind == "complete":
            key = (e.name, e.attempt)
            with self.lock:
                self.completes[key] = self.completes.get(key, 0) + 1
        if e.kind == "claimed":
            return  # the handler reports it, with resumeFrom
        if e.kind in ("idle", "error") or e.status is None:
            if e.kind == "idle":
                self.event(event="idle")
            else:
                self.event(event="error", message="%s: %s" % (e.kind, e.message) if e.kind != "error" else e.message)
            return
        if e.kind == "lost":
            self.event(event="lost", name=e.name, attempt=e.attempt)
            self.say("lost %s (%s)" % (e.name, e.message))
            return
        if e.kind == "heartbeat":
            key = (e.name, e.attempt)
            if isinstance(e.checkpoint, dict) and e.status == 200:
                self.offsets[key] = e.checkpoint.get("offset")
            offset = e.checkpoint.get("offset") if isinstance(e.checkpoint, dict) else self.offsets.get(key, 0)
            self.event(event="heartbeat", name=e.name, attempt=e.attempt, status=e.status, error=e.error, offset=offset)
            return
        self.event(event=e.kind, name=e.name, attempt=e.attempt, status=e.status, error=e.error)
        if e.status != 200:
            self.say("%s of %s refused: %s %s: %s" % (e.kind, e.name, e.status, e.error, e.message))


# --------------------------------------------------------------------------
# tasks. update() is pure: it returns a new state, so an interrupted chunk
# leaves the last committed state untouched.


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def ceil_div(a, b):
    return -(-a // b)


def read_at(f, offset, length):
    f.seek(offset)
    return f.read(length)


class WordCount:
    def initial(self):
        return {"lines": 0, "words": 0, "bytes": 0, "inWord": False}

    def check(self, state, offset, plan):
        for key in ("lines", "words", "bytes"):
            if not is_int(state.get(key)) or state[key] < 0:
                return "state.%s must be a non-negative integer" % key
        if not isinstance(state.get("inWord"), bool):
            return "state.inWord must be a boolean"
        if state["bytes"] != offset:
            return "state.bytes (%d) != offset (%d)" % (state["bytes"], offset)
        return None

    def update(self, state, chunk, offset, f, plan):
        words = len(chunk.split())
        if state["inWord"] and chunk[0] not in WHITESPACE:
            words -= 1  # this chunk continues a word counted in the previous one
        return {
            "lines": state["lines"] + chunk.count(b"\n"),
            "words": state["words"] + words,
            "bytes": state["bytes"] + len(chunk),
            "inWord": chunk[-1] not in WHITESPACE,
        }

    def finish(self, state, f, plan):
        return {"lines": state["lines"], "words": state["words"], "bytes": state["bytes"]}


class Sha256:
    def initial(self):
        return {"chunkDigests": []}

    def check(self, state, offset, plan):
        digests = state.get("chunkDigests")
        if not isinstance(digests, list):
            return "state.chunkDigests must be a list"
        for d in digests:
            if not (isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d)):
                return "state.chunkDigests holds something that is not a sha256 hex digest"
        if len(digests) != ceil_div(offset, plan["chunkBytes"]):
            return "%d chunk digests do not match offset %d" % (len(digests), offset)
        if offset != min(len(digests) * plan["chunkBytes"], plan["size"]):
            return "offset %d is not on a chunk boundary" % offset
        return None

    def update(self, state, chunk, offset, f, plan):
        return {"chunkDigests": state["chunkDigests"] + [hashlib.sha256(chunk).hexdigest()]}

    def finish(self, state, f, plan):
        digests = state["chunkDigests"]
        whole = hashlib.sha256()
        f.seek(0)
        for i, expected in enumerate(digests):
            chunk = f.read(plan["chunkBytes"] if i + 1 < len(digests) else plan["size"] - i * plan["chunkBytes"])
            whole.update(chunk)
            if hashlib.sha256(chunk).hexdigest() != expected:
                raise leasehold.Fail(
                    "FileChanged",
                    "payload.file: %s changed while being hashed (chunk %d differs from its checkpointed digest)"
                    % (json.dumps(plan["file"]), i),
                    False,
                )
        return {
            "sha256": whole.hexdigest(),
            "chunks": len(digests),
            "chunkBytes": plan["chunkBytes"],
            "bytes": plan["size"],
            "chunkListSha256": hashlib.sha256("".join(digests).encode("ascii")).hexdigest(),
        }


def deflate_piece(chunk, dictionary):
    """Raw deflate of one chunk, primed with the preceding bytes, sync-flushed."""
    if dictionary:
        c = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -15, 8, zlib.Z_DEFAULT_STRATEGY, zdict=dictionary)
    else:
        c = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -15, 8, zlib.Z_DEFAULT_STRATEGY)
    return c.compress(chunk) + c.flush(zlib.Z_SYNC_FLUSH)


def deflate_final_block():
    """The empty final block that ends the concatenated deflate stream."""
    return zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)


def gzip_dictionary(f, offset):
    start = max(0, offset - GZIP_WINDOW)
    return read_at(f, start, offset - start)


class Gzip:
    def initial(self):
        return {"deflateBytes": 0, "crc32": 0, "chunks": 0}

    def check(self, state, offset, plan):
        for key in ("deflateBytes", "chunks"):
            if not is_int(state.get(key)) or state[key] < 0:
                return "state.%s must be a non-negative integer" % key
        crc = state.get("crc32")
        if not is_int(crc) or not 0 <= crc <= 0xFFFFFFFF:
            return "state.crc32 must be an unsigned 32-bit integer"
        if (offset == 0) != (state["chunks"] == 0):
            return "state.chunks (%d) does not match offset %d" % (state["chunks"], offset)
        return None

    def update(self, state, chunk, offset, f, plan):
        piece = deflate_piece(chunk, gzip_dictionary(f, offset))
        return {
            "deflateBytes": state["deflateBytes"] + len(piece),
            "crc32": zlib.crc32(chunk, state["crc32"]) & 0xFFFFFFFF,
            "chunks": state["chunks"] + 1,
        }

    def finish(self, state, f, plan):
        size = len(GZIP_HEADER) + state["deflateBytes"] + len(deflate_final_block()) + GZIP_TRAILER_BYTES
        return {
            "originalBytes": plan["size"],
            "compressedBytes": size,
            "ratio": round(float(size) / plan["size"], 4) if plan["size"] else None,
            "crc32": "%08x" % state["crc32"],
            "chunks": state["chunks"],
            "level": GZIP_LEVEL,
        }


PROCESSORS = {"wordcount": WordCount(), "sha256": Sha256(), "gzip": Gzip()}


# --------------------------------------------------------------------------
# payload and checkpoint


def validate_payload(payload, data_dir):
    """Returns a plan dict or raises BadPayload naming the field and value."""
    if not isinstance(payload, dict):
        raise BadPayload("payload: expected a JSON object, got %s" % json.dumps(payload))
    task = payload.get("task")
    if "task" not in payload:
        raise BadPayload("payload.task: missing (expected one of %s)" % ", ".join(TASKS))
    if task not in TASKS:
        raise BadPayload("payload.task: unknown task %s (expected one of %s)" % (json.dumps(task), ", ".join(TASKS)))

    if "file" not in payload:
        raise BadPayload("payload.file: missing")
    name = payload["file"]
    if not isinstance(name, str) or not name:
        raise BadPayload("payload.file: expected a non-empty path string, got %s" % json.dumps(name))
    shown = json.dumps(name)
    root = os.path.realpath(data_dir)
    try:
        path = os.path.realpath(os.path.join(root, name))
    except ValueError as err:  # e.g. an embedded NUL
        raise BadPayload("payload.file: %s is not a usable path: %s" % (shown, err))
    if os.path.commonpath([root, path]) != root:
        raise BadPayload("payload.file: %s is outside the allowed directory %s" % (shown, data_dir))
    if not os.path.exists(path):
        raise BadPayload("payload.file: %s does not exist" % shown)
    if not os.path.isfile(path):
        raise BadPayload("payload.file: %s is not a regular file" % shown)
    try:
        with open(path, "rb") as f:
            f.read(1)
            size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise BadPayload("payload.file: %s is not readable: %s" % (shown, err.strerror or err))

    chunk_bytes = payload.get("chunkBytes", DEFAULT_CHUNK_BYTES)
    if not is_int(chunk_bytes) or not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise BadPayload(
            "payload.chunkBytes: expected an integer from 1 to %d, got %s" % (MAX_CHUNK_BYTES, json.dumps(chunk_bytes))
        )
    delay = payload.get("chunkDelaySeconds", DEFAULT_CHUNK_DELAY)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= MAX_CHUNK_DELAY:
        raise BadPayload(
            "payload.chunkDelaySeconds: expected a number from 0 to %g, got %s" % (MAX_CHUNK_DELAY, json.dumps(delay))
        )
    return {"task": task, "file": name, "path": path, "size": size, "chunkBytes": chunk_bytes, "delay": float(delay)}


def make_checkpoint(plan, offset, state):
    return {
        "v": CHECKPOINT_VERSION,
        "task": plan["task"],
        "file": plan["file"],
        "chunkBytes": plan["chunkBytes"],
        "fileSize": plan["size"],
        "offset": offset,
        "state": state,
    }


def resume_point(plan, checkpoint):
    """Returns (offset, state, why_not) for the checkpoint handed out with a claim."""
    processor = PROCESSORS[plan["task"]]
    fresh = (0, processor.initial())
    if checkpoint is None:
        return fresh + (None,)
    if not isinstance(checkpoint, dict):
        return fresh + ("checkpoint is not an object",)
    if checkpoint.get("v") != CHECKPOINT_VERSION:
        return fresh + ("checkpoint version %s is not %d" % (json.dumps(checkpoint.get("v")), CHECKPOINT_VERSION),)
    for key in ("task", "file", "chunkBytes"):
        if checkpoint.get(key) != plan[key]:
            return fresh + ("checkpoint %s %s does not match the payload" % (key, json.dumps(checkpoint.get(key))),)
    if checkpoint.get("fileSize") != plan["size"]:
        return fresh + ("file size changed since the checkpoint was taken",)
    offset, state = checkpoint.get("offset"), checkpoint.get("state")
    if not is_int(offset) or not 0 <= offset <= plan["size"]:
        return fresh + ("checkpoint offset %s is out of range" % json.dumps(offset),)
    if not isinstance(state, dict):
        return fresh + ("checkpoint state is not an object",)
    problem = processor.check(state, offset, plan)
    if problem:
        return fresh + ("checkpoint rejected: " + problem,)
    return offset, state, None


# --------------------------------------------------------------------------
# the handler


class Handler:
    """Runs one job: the task over the file, chunk by chunk, from the checkpoint."""

    def __init__(self, args, out, client):
        self.args = args
        self.out = out
        self.client = client

    def __call__(self, job):
        out = self.out
        try:
            plan = validate_payload(job.payload, self.args.data_dir)
        except BadPayload as err:
            out.event(event="claimed", name=job.name, attempt=job.attempt, resumeFrom=0)
            out.say("claimed %s attempt %s: bad payload: %s" % (job.label, job.attempt, err))
            raise
        offset, state, why_not = resume_point(plan, job.checkpoint)
        resumed_from = offset
        out.event(event="claimed", name=job.name, attempt=job.attempt, resumeFrom=offset)
        out.say(
            "claimed %s attempt %s: %s of %s (%d bytes, %d-byte chunks, %gs each, lease %gs)"
            % (job.label, job.attempt, plan["task"], plan["file"], plan["size"],
               plan["chunkBytes"], plan["delay"], job.lease_duration)
        )
        if why_not:
            out.say("ignoring the previous attempt's checkpoint (%s); starting fresh" % why_not)
        elif offset:
            out.say("resuming at byte %d of %d from the previous attempt's checkpoint" % (offset, plan["size"]))

        processor = PROCESSORS[plan["task"]]
        try:
            with open(plan["path"], "rb") as f:
                while offset < plan["size"]:
                    chunk = read_at(f, offset, min(plan["chunkBytes"], plan["size"] - offset))
                    if not chunk:
                        raise leasehold.Fail(
                            "ReadError", "payload.file: %s ended early at byte %d" % (json.dumps(plan["file"]), offset), True
                        )
                    next_state = processor.update(state, chunk, offset, f, plan)
                    self.pause(job, plan["delay"])
                    offset, state = offset + len(chunk), next_state
                    job.save(make_checkpoint(plan, offset, state))
                    job.progress(offset / plan["size"], "%d of %d bytes" % (offset, plan["size"]))
                    out.say("%s: %d/%d bytes" % (job.name, offset, plan["size"]))
                figures = processor.finish(state, f, plan)
        except OSError as err:
            raise leasehold.Fail("ReadError", "payload.file: %s: %s" % (json.dumps(plan["file"]), err), True)
        result = {"task": plan["task"]}
        result.update(figures)
        result.update({"file": plan["file"], "resumedFromOffset": resumed_from, "worker": self.args.name})
        if self.args.insist:
            return self.insist(job, result)
        out.say("completing %s: %s" % (job.name, json.dumps(result)))
        return result

    def insist(self, job, result):
        """--insist: what a naive worker would do. It sends its result with the token it was
        given even when the lease is known lost, whenever that was learnt: before this point,
        or while the client's own complete waited (a worker frozen right here wakes to a lost
        lease, and the client's guard would withhold the result). The sidecar and the API
        server refuse it with 409. (A loss the client only presumed, LeaseUnconfirmed, after
        its heartbeats failed, may not be one: then the result can still be accepted.)"""
        if job.lost is None:
            self.out.say("completing %s: %s" % (job.name, json.dumps(result)))
            key = (job.name, job.attempt)
            sent = self.out.completes.get(key, 0)
            try:
                job.complete(result)
                return None
            except leasehold.JobLost:
                if self.out.completes.get(key, 0) != sent:
                    return None  # sent, and refused: insisted on already
                # Learnt just now, and the guard withheld the result: send it anyway.
        self.out.say("--insist: lease was lost, completing %s anyway" % job.name)
        try:
            self.client.complete(job.name, job.token, result, job.attempt)
        except leasehold.LeaseholdError:
            pass
        return None

    def pause(self, job, delay):
        """The chunk's simulated work. Raises when the job is lost or the worker stops,
        except that --insist carries on after a lost lease."""
        if not self.args.insist:
            job.sleep(delay)
            return
        deadline = time.monotonic() + delay
        while True:
            if job.stopping:
                job.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.1))


# --------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Example leasehold worker: claims jobs from the sidecar and runs wordcount, sha256 "
        "or gzip over a license text in chunks, checkpointing after each chunk.",
        epilog="Stdout carries one JSON event per line (claimed, heartbeat, complete, fail, release, lost, "
        "idle, error); narration goes to stderr. The first SIGTERM/SIGINT stops the worker between jobs, or "
        "mid-job at the next chunk boundary after releasing the job (with its last checkpoint, for the next "
        "worker); a second signal exits immediately. See the module docstring for the payload, checkpoint "
        "and event formats.",
    )
    parser.add_argument("--sidecar", default=os.environ.get("LEASEHOLD_SIDECAR", "http://127.0.0.1:7070"),
                        metavar="URL", help="sidecar base URL (default: $LEASEHOLD_SIDECAR or %(default)s)")
    parser.add_argument("--wait", type=int, default=20, metavar="SECONDS",
                        help="long-poll duration for each claim, 0..300 (default: %(default)s)")
    parser.add_argument("--name", default=socket.gethostname(),
                        help="worker name, reported in results and narration (default: hostname, %(default)s)")
    parser.add_argument("--once", action="store_true", help="process one job, then exit (same as --max-jobs 1)")
    parser.add_argument("--max-jobs", type=int, default=0, metavar="N",
                        help="exit after processing N jobs; 0 means no limit (default: %(default)s)")
    parser.add_argument("--exit-when-idle", action="store_true",
                        help="exit as soon as a claim finds nothing to do (204)")
    parser.add_argument("--insist", action="store_true",
                        help="misbehave: after losing the lease keep working to the end and still send the "
                        "result, bypassing the client's guard (demonstrates that a zombie's late result is refused)")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                        help="payload.file must resolve inside this directory (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.wait <= 300:
        parser.error("--wait must be from 0 to 300")
    if args.max_jobs < 0:
        parser.error("--max-jobs must be >= 0")
    if args.once:
        args.max_jobs = 1
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Output(args.name)
    log = logging.StreamHandler(sys.stderr)
    log.setFormatter(logging.Formatter("[%s] %%(message)s" % args.name))
    logging.getLogger("leasehold").addHandler(log)
    logging.getLogger("leasehold").setLevel(logging.INFO)
    try:
        client = leasehold.Client(args.sidecar, on_event=out.on_event)
    except ValueError as err:
        sys.exit("--sidecar: %s" % err)
    worker = leasehold.Worker(Handler(args, out, client), client=client, wait=args.wait, max_jobs=args.max_jobs,
                              exit_when_idle=args.exit_when_idle)
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
