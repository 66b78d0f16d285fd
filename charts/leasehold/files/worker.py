#!/usr/bin/env python3
"""Example leasehold worker: standard-library Python, no dependencies.

It long-polls the leasehold sidecar for a job, does the work in chunks, sends a
heartbeat carrying a resumable checkpoint after every chunk, and finally
completes (or fails) the job, proving its lease with the token every time.

Job payload:
    {"task": "wordcount" | "sha256" | "gzip",
     "file": "/usr/share/common-licenses/<NAME>",
     "chunkBytes": 4096,            # optional, 1..16777216
     "chunkDelaySeconds": 0.2}      # optional, 0..3600 (simulated slow work)

Checkpoint (sent with every per-chunk heartbeat, handed back on a re-claim):
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

Stdout: one JSON object per line, flushed at once:
    {"event":"claimed","name","attempt","resumeFrom"}
    {"event":"heartbeat","name","attempt","status","error","offset"}
    {"event":"complete","name","attempt","status","error"}
    {"event":"fail","name","attempt","status","error"}
    {"event":"release","name","attempt","status","error"}
    {"event":"lost","name","attempt"}
    {"event":"idle"}
    {"event":"error","message"}
"status" is the HTTP status, "error" the server's error code or null.
Every "claimed" is followed by exactly one outcome: a complete, fail or
release event with status 200, or a "lost" event. Connection failures produce
"error" events (no status) and are retried with a short backoff.
Narration for humans goes to stderr, prefixed with "[NAME]".
"""

import argparse
import hashlib
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib

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
HTTP_TIMEOUT = 10.0
WRITE_TRIES = 5  # complete / fail / release attempts on connection errors or 5xx
HEARTBEAT_TRIES = 3


class BadPayload(Exception):
    pass


class WorkError(Exception):
    def __init__(self, reason, message, retryable):
        Exception.__init__(self, message)
        self.reason = reason
        self.retryable = retryable


# --------------------------------------------------------------------------
# output


class Output:
    def __init__(self, name):
        self.name = name
        self.lock = threading.Lock()

    def event(self, **fields):
        line = json.dumps(fields, separators=(",", ":"))
        with self.lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def say(self, message):
        with self.lock:
            sys.stderr.write("[%s] %s\n" % (self.name, message))
            sys.stderr.flush()


# --------------------------------------------------------------------------
# sidecar client


class ConnectionFailed(Exception):
    pass


class Reply:
    def __init__(self, status, body):
        self.status = status
        self.body = body
        self.error = None
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            self.error = body["error"]

    def describe(self):
        text = "HTTP %d" % self.status
        if self.error:
            text += " " + self.error
        if isinstance(self.body, dict) and isinstance(self.body.get("message"), str):
            text += ": " + self.body["message"]
        return text


class Sidecar:
    def __init__(self, base_url):
        self.base = base_url.rstrip("/")
        # The sidecar is local: never route it through an HTTP(S)_PROXY.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def post(self, path, body=None, timeout=HTTP_TIMEOUT):
        headers = {"Accept": "application/json"}
        data = b""
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
        try:
            try:
                with self.opener.open(request, timeout=timeout) as response:
                    status, raw = response.status, response.read()
            except urllib.error.HTTPError as err:
                status = err.code
                try:
                    raw = err.read()
                finally:
                    err.close()
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", None) or err
            raise ConnectionFailed("%s %s: %s" % ("POST", self.base + path, reason))
        parsed = None
        if raw:
            try:
                parsed = json.loads(raw.decode("utf-8"))
            except ValueError:
                parsed = None
        return Reply(status, parsed)

    @staticmethod
    def job_path(name, verb):
        return "/v1/jobs/%s/%s" % (urllib.parse.quote(name, safe=""), verb)


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
                raise WorkError(
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
# the worker


class Lease:
    """Lease bookkeeping for one claimed job; shared with the background heartbeater."""

    def __init__(self, claim):
        self.name = claim["name"]
        self.namespace = claim.get("namespace")
        self.attempt = claim.get("attempt")
        self.token = claim["token"]
        duration = claim.get("leaseDurationSeconds")
        self.duration = float(duration) if is_int(duration) or isinstance(duration, float) else 15.0
        if self.duration <= 0:
            self.duration = 15.0
        self.last_renewed = time.monotonic()
        self.offset = 0  # last offset successfully handed to a heartbeat
        self.lost = False
        self.lost_reason = None

    def label(self):
        return "%s/%s" % (self.namespace, self.name) if self.namespace else self.name


class Worker:
    def __init__(self, args):
        self.args = args
        self.out = Output(args.name)
        self.sidecar = Sidecar(args.sidecar)
        self.stopping = False  # set by the first SIGTERM/SIGINT (only a flag: safe in a handler)

    # ---- small helpers

    def pause(self, seconds):
        """Sleeps, waking early when asked to stop. Returns False if stopping."""
        deadline = time.monotonic() + seconds
        while not self.stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            time.sleep(min(remaining, 0.1))
        return False

    def on_signal(self, signum, frame):
        if self.stopping:
            sys.stderr.write("[%s] second signal: exiting now\n" % self.args.name)
            sys.stderr.flush()
            os._exit(128 + signum)
        self.stopping = True

    # ---- main loop

    def run(self):
        self.out.say("worker for %s, long-polling %ds per claim" % (self.args.sidecar, self.args.wait))
        done = 0
        backoff = 0.5
        while not self.stopping:
            if self.args.max_jobs and done >= self.args.max_jobs:
                self.out.say("processed %d job(s), exiting" % done)
                return 0
            outcome = self.claim()
            if outcome is None:  # stopped while waiting
                break
            kind, value = outcome
            if kind == "error":
                self.out.event(event="error", message=value)
                self.out.say("%s; retrying in %.1fs" % (value, backoff))
                self.pause(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.5
            if kind == "idle":
                self.out.event(event="idle")
                if self.args.exit_when_idle:
                    self.out.say("nothing to do, exiting (--exit-when-idle)")
                    return 0
                if self.args.wait == 0:
                    self.pause(1.0)
                continue
            done += 1
            try:
                self.process(value)
            except Exception as err:  # never let a bug in one job kill the worker
                self.out.event(event="error", message="internal error while processing: %r" % (err,))
        self.out.say("stopping on signal")
        return 0

    def claim(self):
        """Long-polls in a helper thread so a signal can interrupt the wait.

        Returns ("job", claim) / ("idle", None) / ("error", message), or None
        if a signal arrived first. A job claimed in the very moment of the
        signal is released straight away."""
        result = {}
        finished = threading.Event()

        def call():
            try:
                result["reply"] = self.sidecar.post("/v1/claim?wait=%d" % self.args.wait, timeout=self.args.wait + 15)
            except ConnectionFailed as err:
                result["failure"] = str(err)
            except Exception as err:
                result["failure"] = "claim: %r" % (err,)
            finished.set()

        threading.Thread(target=call, name="claim", daemon=True).start()
        while not finished.wait(0.1):
            if self.stopping:
                return None
        if "failure" in result:
            return ("error", result["failure"])
        reply = result["reply"]
        if reply.status == 204:
            return ("idle", None)
        if reply.status != 200:
            return ("error", "claim: " + reply.describe())
        body = reply.body
        if not (isinstance(body, dict) and isinstance(body.get("name"), str) and isinstance(body.get("token"), str)):
            return ("error", "claim: malformed 200 response %s" % json.dumps(body)[:200])
        if self.stopping:
            lease = Lease(body)
            self.out.event(event="claimed", name=lease.name, attempt=lease.attempt, resumeFrom=0)
            self.release(lease)
            return None
        return ("job", body)

    # ---- one job

    def process(self, claim):
        lease = Lease(claim)
        out = self.out
        try:
            plan = validate_payload(claim.get("payload"), self.args.data_dir)
        except BadPayload as err:
            out.event(event="claimed", name=lease.name, attempt=lease.attempt, resumeFrom=0)
            out.say("claimed %s attempt %s: bad payload: %s" % (lease.label(), lease.attempt, err))
            self.fail(lease, "BadPayload", str(err), False)
            return
        offset, state, why_not = resume_point(plan, claim.get("checkpoint"))
        lease.offset = offset
        resumed_from = offset
        out.event(event="claimed", name=lease.name, attempt=lease.attempt, resumeFrom=offset)
        out.say(
            "claimed %s attempt %s: %s of %s (%d bytes, %d-byte chunks, %gs each, lease %gs)"
            % (lease.label(), lease.attempt, plan["task"], plan["file"], plan["size"],
               plan["chunkBytes"], plan["delay"], lease.duration)
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
                        raise WorkError("ReadError", "payload.file: %s ended early at byte %d" % (json.dumps(plan["file"]), offset), True)
                    next_state = processor.update(state, chunk, offset, f, plan)
                    self.simulate_work(lease, plan["delay"])
                    if self.stopping:
                        out.say("signal received: handing %s back at byte %d" % (lease.name, lease.offset))
                        self.release(lease)
                        return
                    if lease.lost and not self.args.insist:
                        return self.give_up(lease)
                    offset, state = offset + len(chunk), next_state
                    self.heartbeat(lease, make_checkpoint(plan, offset, state), offset)
                    if lease.lost and not self.args.insist:
                        return self.give_up(lease)
                    if not lease.lost and time.monotonic() - lease.last_renewed > lease.duration:
                        lease.lost, lease.lost_reason = True, "no successful heartbeat for longer than the lease duration"
                        if not self.args.insist:
                            return self.give_up(lease)
                    out.say("%s: %d/%d bytes" % (lease.name, offset, plan["size"]))
                    if self.stopping:
                        out.say("signal received: handing %s back at byte %d" % (lease.name, offset))
                        self.release(lease)
                        return
                figures = processor.finish(state, f, plan)
        except WorkError as err:
            out.say("%s: %s" % (lease.name, err))
            self.fail(lease, err.reason, str(err), err.retryable)
            return
        except OSError as err:
            out.say("%s: reading failed: %s" % (lease.name, err))
            self.fail(lease, "ReadError", "payload.file: %s: %s" % (json.dumps(plan["file"]), err), True)
            return
        except Exception as err:  # a bug here must not leave the job hanging until its lease expires
            out.say("%s: internal error: %r" % (lease.name, err))
            self.fail(lease, "WorkerError", "internal worker error: %r" % (err,), True)
            return
        result = {"task": plan["task"]}
        result.update(figures)
        result.update({"file": plan["file"], "resumedFromOffset": resumed_from, "worker": self.args.name})
        if lease.lost:
            out.say("--insist: lease was lost, completing %s anyway" % lease.name)
        self.complete(lease, result)

    def give_up(self, lease):
        self.out.event(event="lost", name=lease.name, attempt=lease.attempt)
        self.out.say("lost the lease on %s (%s): stopping work on it" % (lease.name, lease.lost_reason))

    def simulate_work(self, lease, delay):
        """Sleeps `delay` seconds for the chunk. When that is long compared with
        the lease, a background thread keeps renewing it meanwhile."""
        if delay <= 0:
            return
        stop = threading.Event()
        helper = None
        if delay > lease.duration / 3.0 and not lease.lost:

            def renew():
                while not stop.wait(lease.duration / 3.0):
                    if self.stopping or lease.lost:
                        return
                    self.heartbeat(lease, None, lease.offset, tries=1)

            helper = threading.Thread(target=renew, name="heartbeater", daemon=True)
            helper.start()
        deadline = time.monotonic() + delay
        try:
            while not self.stopping and not (lease.lost and not self.args.insist):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                time.sleep(min(remaining, 0.1))
        finally:
            stop.set()
            if helper is not None:
                helper.join()

    # ---- writes to the sidecar

    def heartbeat(self, lease, checkpoint, offset, tries=HEARTBEAT_TRIES):
        body = {"token": lease.token}
        if checkpoint is not None:
            body["checkpoint"] = checkpoint
        path = Sidecar.job_path(lease.name, "heartbeat")
        for attempt in range(tries):
            if attempt and not self.pause(0.5 * attempt):
                return
            try:
                reply = self.sidecar.post(path, body, timeout=min(HTTP_TIMEOUT, max(1.0, lease.duration / 2.0)))
            except ConnectionFailed as err:
                self.out.event(event="error", message="heartbeat: %s" % err)
                continue
            self.out.event(event="heartbeat", name=lease.name, attempt=lease.attempt,
                           status=reply.status, error=reply.error, offset=offset)
            if reply.status == 200:
                lease.last_renewed = time.monotonic()
                if checkpoint is not None:
                    lease.offset = offset
                duration = reply.body.get("leaseDurationSeconds") if isinstance(reply.body, dict) else None
                if (is_int(duration) or isinstance(duration, float)) and duration > 0:
                    lease.duration = float(duration)
                return
            if reply.status in (404, 409):
                if not lease.lost:
                    lease.lost, lease.lost_reason = True, "heartbeat refused: " + reply.describe()
                    if self.args.insist:
                        self.out.say("lease on %s lost (%s) but --insist: carrying on" % (lease.name, reply.describe()))
                return
            if reply.status < 500:
                self.out.say("heartbeat for %s: %s (carrying on)" % (lease.name, reply.describe()))
                return
            # 5xx: retry

    def write(self, lease, verb, body):
        """complete / fail / release. True when the server accepted it."""
        path = Sidecar.job_path(lease.name, verb)
        delay = 0.5
        for attempt in range(WRITE_TRIES):
            if attempt:
                time.sleep(delay)  # not interruptible: finishing the write is the clean exit
                delay = min(delay * 2, 4.0)
            try:
                reply = self.sidecar.post(path, body)
            except ConnectionFailed as err:
                self.out.event(event="error", message="%s: %s" % (verb, err))
                continue
            self.out.event(event=verb, name=lease.name, attempt=lease.attempt, status=reply.status, error=reply.error)
            if reply.status == 200:
                return True
            if reply.status < 500:
                self.out.say("%s of %s refused: %s" % (verb, lease.name, reply.describe()))
                break
        lease.lost_reason = lease.lost_reason or "%s was not accepted" % verb
        self.out.event(event="lost", name=lease.name, attempt=lease.attempt)
        self.out.say("giving up %s" % lease.name)
        return False

    def complete(self, lease, result):
        if self.write(lease, "complete", {"token": lease.token, "result": result}):
            self.out.say("completed %s: %s" % (lease.name, json.dumps(result)))

    def fail(self, lease, reason, message, retryable):
        body = {"token": lease.token, "reason": reason, "message": message, "retryable": retryable}
        if self.write(lease, "fail", body):
            self.out.say("reported %s as failed (%s, retryable=%s)" % (lease.name, reason, str(retryable).lower()))

    def release(self, lease):
        if self.write(lease, "release", {"token": lease.token}):
            self.out.say("released %s" % lease.name)


# --------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Example leasehold worker: claims jobs from the sidecar and runs wordcount, sha256 "
        "or gzip over a license text in chunks, heartbeating a resumable checkpoint after each chunk.",
        epilog="Stdout carries one JSON event per line (claimed, heartbeat, complete, fail, release, lost, "
        "idle, error); narration goes to stderr. The first SIGTERM/SIGINT stops the worker between jobs, or "
        "mid-job at the next chunk boundary after releasing the job (its last checkpoint stays for the next "
        "worker); a second signal exits immediately. See the module docstring for the payload, checkpoint "
        "and event formats.",
    )
    parser.add_argument("--sidecar", default=os.environ.get("LEASEHOLD_SIDECAR", "http://127.0.0.1:7070"),
                        metavar="URL", help="sidecar base URL (default: $LEASEHOLD_SIDECAR or %(default)s)")
    parser.add_argument("--wait", type=int, default=20, metavar="SECONDS",
                        help="long-poll duration for each claim (default: %(default)s)")
    parser.add_argument("--name", default=socket.gethostname(),
                        help="worker name, reported in results and narration (default: hostname, %(default)s)")
    parser.add_argument("--once", action="store_true", help="process one job, then exit (same as --max-jobs 1)")
    parser.add_argument("--max-jobs", type=int, default=0, metavar="N",
                        help="exit after processing N jobs; 0 means no limit (default: %(default)s)")
    parser.add_argument("--exit-when-idle", action="store_true",
                        help="exit as soon as a claim finds nothing to do (204)")
    parser.add_argument("--insist", action="store_true",
                        help="misbehave: on a 409 keep working to the end and still call complete "
                        "(demonstrates that a zombie's late result is refused)")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                        help="payload.file must resolve inside this directory (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.wait < 0:
        parser.error("--wait must be >= 0")
    if args.max_jobs < 0:
        parser.error("--max-jobs must be >= 0")
    if args.once:
        args.max_jobs = 1
    if urllib.parse.urlsplit(args.sidecar).scheme not in ("http", "https"):
        parser.error("--sidecar must be an http:// or https:// URL")
    return args


def main(argv=None):
    args = parse_args(argv)
    worker = Worker(args)
    signal.signal(signal.SIGTERM, worker.on_signal)
    signal.signal(signal.SIGINT, worker.on_signal)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
