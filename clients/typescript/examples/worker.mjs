#!/usr/bin/env node
// Example leasehold worker on the TypeScript client (package `leasehold`).
//
// It claims jobs from the sidecar, reads a file in chunks, saves a resumable checkpoint after
// every chunk (the client sends it with its background heartbeats), reports progress, and
// completes the job or fails it. Lease loss, cancellation and SIGTERM are the client's: see
// clients/typescript/README.md. What is left here is the task.
//
// Job payload:
//   {"task": "wordcount" | "sha256", "file": "/path/to/file",
//    "chunkBytes": 4096,           // optional, 1..16777216
//    "chunkDelaySeconds": 0}       // optional, 0..3600 (simulated slow work)
// Checkpoint: {"v": 1, "task", "file", "chunkBytes", "fileSize", "offset", "state"}
//   wordcount: state {lines, words, inWord} (inWord: a word straddles the chunk boundary);
//              counts agree with `LC_ALL=C wc`.
//   sha256:    state {chunkDigests: [hex...]}; at the end the whole file is hashed, and each
//              chunk's digest checked against it.
//   A checkpoint that does not match the payload or the file is ignored: start fresh.
//
// Environment: LEASEHOLD_SIDECAR (default http://127.0.0.1:7070), LEASEHOLD_CONCURRENCY
// (default 1), LEASEHOLD_WAIT (seconds each claim long-polls, default 20),
// LEASEHOLD_EXIT_WHEN_IDLE=1 to stop once a claim finds nothing.

import { createHash } from "node:crypto";
import { open, stat } from "node:fs/promises";

// Installed (npm install leasehold), or run from a checkout beside the built client.
const { Fail, run } = await import("leasehold").catch(() => import("../dist/index.js"));

const WHITESPACE = new Set([0x20, 0x09, 0x0a, 0x0b, 0x0c, 0x0d]); // C-locale wc's

function checkPayload(payload) {
  const p = payload ?? {};
  if (p.task !== "wordcount" && p.task !== "sha256") {
    throw new Fail("BadPayload", `payload.task: expected "wordcount" or "sha256", not ${JSON.stringify(p.task)}`);
  }
  if (typeof p.file !== "string" || !p.file) throw new Fail("BadPayload", "payload.file: missing");
  const chunkBytes = p.chunkBytes ?? 4096;
  if (!Number.isInteger(chunkBytes) || chunkBytes < 1 || chunkBytes > 16 * 1024 * 1024) {
    throw new Fail("BadPayload", `payload.chunkBytes: expected 1..16777216, not ${chunkBytes}`);
  }
  const delay = p.chunkDelaySeconds ?? 0;
  if (typeof delay !== "number" || delay < 0 || delay > 3600) {
    throw new Fail("BadPayload", `payload.chunkDelaySeconds: expected 0..3600, not ${delay}`);
  }
  return { task: p.task, file: p.file, chunkBytes, delay };
}

function fresh(task) {
  return task === "wordcount" ? { lines: 0, words: 0, inWord: false } : { chunkDigests: [] };
}

/** The checkpoint to resume from, if it is one of this payload and file. */
function resumable(checkpoint, spec, fileSize) {
  const c = checkpoint;
  if (!c || c.v !== 1 || c.task !== spec.task || c.file !== spec.file) return undefined;
  if (c.chunkBytes !== spec.chunkBytes || c.fileSize !== fileSize) return undefined;
  if (!Number.isInteger(c.offset) || c.offset < 0 || c.offset > fileSize || typeof c.state !== "object") return undefined;
  return c;
}

function count(state, chunk) {
  for (const byte of chunk) {
    if (byte === 0x0a) state.lines += 1;
    if (WHITESPACE.has(byte)) state.inWord = false;
    else if (!state.inWord) {
      state.inWord = true;
      state.words += 1;
    }
  }
}

async function handle(job) {
  const spec = checkPayload(job.payload);
  let size;
  try {
    size = (await stat(spec.file)).size;
  } catch (err) {
    throw new Fail("NoSuchFile", `${spec.file}: ${err.message}`);
  }
  const resumed = resumable(job.checkpoint, spec, size);
  let offset = resumed?.offset ?? 0;
  const state = resumed?.state ?? fresh(spec.task);
  console.error(`[${job.name}] ${spec.task} of ${spec.file} (attempt ${job.attempt}) from byte ${offset} of ${size}`);
  const file = await open(spec.file, "r");
  try {
    while (offset < size) {
      const buffer = Buffer.alloc(Math.min(spec.chunkBytes, size - offset));
      const { bytesRead } = await file.read(buffer, 0, buffer.length, offset);
      const chunk = buffer.subarray(0, bytesRead);
      if (spec.task === "wordcount") count(state, chunk);
      else state.chunkDigests.push(createHash("sha256").update(chunk).digest("hex"));
      offset += bytesRead;
      job.save({ v: 1, ...spec, delay: undefined, fileSize: size, offset, state });
      job.progress(offset / size, `${offset} of ${size} bytes`);
      if (spec.delay) await job.sleep(spec.delay); // wakes at once if the job is lost or the worker stops
      job.check(); // throws once the lease is lost, the job cancelled, or the worker stopping
    }
  } finally {
    await file.close();
  }
  if (spec.task === "wordcount") {
    return { task: "wordcount", bytes: size, lines: state.lines, words: state.words };
  }
  const whole = createHash("sha256");
  const file2 = await open(spec.file, "r");
  try {
    for (let i = 0, at = 0; at < size; i++, at += spec.chunkBytes) {
      const buffer = Buffer.alloc(Math.min(spec.chunkBytes, size - at));
      await file2.read(buffer, 0, buffer.length, at);
      whole.update(buffer);
      if (createHash("sha256").update(buffer).digest("hex") !== state.chunkDigests[i]) {
        throw new Fail("FileChanged", `${spec.file} changed while it was hashed (chunk ${i})`, { retryable: true });
      }
    }
  } finally {
    await file2.close();
  }
  return { task: "sha256", bytes: size, sha256: whole.digest("hex"), chunks: state.chunkDigests.length };
}

const handled = await run(handle, {
  concurrency: Number(process.env.LEASEHOLD_CONCURRENCY ?? 1),
  wait: Number(process.env.LEASEHOLD_WAIT ?? 20),
  exitWhenIdle: process.env.LEASEHOLD_EXIT_WHEN_IDLE === "1",
});
console.error(`handled ${handled} job(s)`);
