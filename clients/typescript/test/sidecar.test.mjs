// The TypeScript client against the real sidecar and control plane (see fixtures.mjs for how it
// is run). Each test has a queue of its own and starts its own sidecars and worker processes.

import assert from "node:assert/strict";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import * as leasehold from "../dist/index.js";
import {
  Events, NAMESPACE, Recorder, SKIP, createJob, kubectl, procsFor, queueFor, status, waitUntil,
} from "./fixtures.mjs";

const { Client, Job, Worker, silentLogger } = leasehold;
const HERE = dirname(fileURLToPath(import.meta.url));
const it = (name, body) => test(name, { skip: SKIP, timeout: 90_000 }, body);

async function claimOne(client, wait = 10, options = { logger: silentLogger }) {
  const job = await Job.claim(client, wait, options);
  assert.ok(job, "nothing claimed");
  return job;
}

function stepsWorker(procs, name, sidecar, onShutdown = "release", extra = []) {
  const proc = procs.start(name, process.execPath, [join(HERE, "steps_worker.mjs"), sidecar.base, onShutdown, ...extra], {
    pipeStdout: true,
  });
  return [proc, new Events(proc)];
}

it("a job is claimed and completed, and its result stored", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("simple", queue, { payload: { n: 7 }, lease: 10 });
  const sidecar = await procs.sidecar(queue, "simple");
  const recorder = new Recorder();
  const client = new Client({ baseUrl: sidecar.base, onEvent: recorder.record });
  const job = await claimOne(client);
  assert.deepEqual(
    [job.name, job.namespace, job.attempt, job.payload, job.checkpoint, job.leaseDurationSeconds],
    ["simple", NAMESPACE, 1, { n: 7 }, null, 10],
  );
  job.start();
  const answer = await job.complete({ words: 12 });
  assert.equal(answer.phase, "Succeeded");
  await job.finish();
  const s = status("simple");
  assert.deepEqual([s.phase, s.attempt, s.result], ["Succeeded", 1, { words: 12 }]);
  assert.deepEqual(recorder.kinds("simple"), [["claimed", 200], ["complete", 200]]);
  await assert.rejects(job.complete({ again: true }), leasehold.JobEnded);
});

it("a failed attempt's next attempt resumes from the checkpoint it saved", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("resume", queue, { lease: 10, maxAttempts: 3, backoff: { initialSeconds: 0, maxSeconds: 0 } });
  const sidecar = await procs.sidecar(queue, "resume");
  const recorder = new Recorder();
  const client = new Client({ baseUrl: sidecar.base, onEvent: recorder.record });
  const first = await claimOne(client);
  first.start();
  first.save({ offset: 4096 });
  const beat = await first.heartbeat();
  assert.equal(beat.leaseDurationSeconds, 10);
  assert.ok(beat.expiresAt);
  first.save({ offset: 8192 }); // sent by the background heartbeats, or at the latest by finish
  await first.heartbeat();
  await first.finish({ error: new Error("disk full") }); // -> fail WorkerError, retryable
  assert.deepEqual(recorder.kinds("resume", 1).at(-1), ["fail", 200]);
  const second = await waitUntil("the retried job", 20, () => Job.claim(client, 2, { logger: silentLogger }));
  assert.deepEqual([second.attempt, second.checkpoint], [2, { offset: 8192 }]);
  second.start();
  await second.complete({ from: second.checkpoint.offset });
  await second.finish();
  const s = status("resume");
  assert.deepEqual([s.phase, s.attempt, s.result], ["Succeeded", 2, { from: 8192 }]);
  assert.deepEqual(s.failures.map((f) => [f.attempt, f.reason, f.message]), [[1, "WorkerError", "Error: disk full"]]);
});

it("background heartbeats keep a job past three leases while its handler makes no calls", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("quiet", queue, { lease: 5 });
  // --worker-timeout 1: the sidecar stops renewing for a worker silent for max(1, 5) s.
  const sidecar = await procs.sidecar(queue, "quiet", ["--worker-timeout", "1"]);
  const recorder = new Recorder();
  const client = new Client({ baseUrl: sidecar.base, onEvent: recorder.record });
  const worker = new Worker(
    async (job) => {
      assert.equal(job.heartbeatInterval, 5 / 3);
      await sleep(16_000);
      job.check();
      return "done";
    },
    { client, wait: 5, maxJobs: 1, handleSignals: false, logger: silentLogger },
  );
  assert.equal(await worker.run(), 1);
  const beats = recorder.events.filter((e) => e.kind === "heartbeat");
  assert.ok(beats.length >= 7 && beats.every((e) => e.status === 200), JSON.stringify(beats));
  const s = status("quiet");
  assert.deepEqual([s.phase, s.attempt, s.result], ["Succeeded", 1, "done"]);
});

it("a cancelled job aborts job.signal with Cancelled within a heartbeat, and no result is sent", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("cancel-me", queue, { lease: 6 });
  const sidecar = await procs.sidecar(queue, "cancel");
  const recorder = new Recorder();
  const client = new Client({ baseUrl: sidecar.base, onEvent: recorder.record });
  let reason;
  let patched;
  const worker = new Worker(
    async (job) => {
      kubectl(["patch", "ljob", "cancel-me", "--type", "merge", "-p", '{"spec":{"cancel":true}}']);
      patched = performance.now();
      // As real work would: a fetch or a timer given the job's signal.
      await sleep(60_000, undefined, { signal: job.signal }).catch((err) => {
        reason = job.signal.reason;
        throw err;
      });
      return "too late";
    },
    { client, wait: 5, maxJobs: 1, handleSignals: false, logger: silentLogger },
  );
  assert.equal(await worker.run(), 1);
  assert.ok(reason instanceof leasehold.Cancelled, String(reason));
  assert.equal(reason.status, 409);
  assert.ok(reason.serverMessage.includes("cancel-me"), reason.serverMessage);
  assert.ok(performance.now() - patched <= (6 / 3 + 3) * 1000);
  assert.equal(status("cancel-me").phase, "Cancelled");
  const kinds = recorder.kinds("cancel-me");
  assert.ok(!kinds.some(([kind]) => kind === "complete" || kind === "fail"), JSON.stringify(kinds));
  assert.deepEqual(kinds.at(-1), ["lost", null]);
});

it("a frozen worker's job goes to another worker, and its late result is refused with lease_lost", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("frozen", queue, { payload: { steps: 30, stepSeconds: 0.2 }, lease: 5 });
  const sidecar = await procs.sidecar(queue, "frozen-a", ["--worker-timeout", "1"]);
  const [worker, events] = stepsWorker(procs, "frozen-worker", sidecar, "release", ["--max-jobs", "1"]);
  const [started] = await events.wait("the job started", { kind: "started" });
  await events.wait("a heartbeat with a checkpoint", { kind: "heartbeat", status: 200 });
  worker.signal("SIGSTOP");
  // Another worker gets the job once the controller requeued it, and finishes it.
  const other = new Client((await procs.sidecar(queue, "frozen-b")).base);
  const job = await waitUntil("the requeued job", 30, () => Job.claim(other, 2, { logger: silentLogger }));
  assert.equal(job.attempt, 2);
  assert.ok(job.checkpoint.step >= 1, JSON.stringify(job.claimAnswer));
  worker.signal("SIGCONT");
  const [lost] = await events.wait("the frozen worker's lost event", { kind: "lost", attempt: 1 }, 10);
  assert.match(lost.message, /lease_lost/);
  // The frozen attempt's result, offered late with its token, is refused by the sidecar too.
  await assert.rejects(
    new Client(sidecar.base).complete("frozen", started.token, { by: "a" }),
    (err) => err instanceof leasehold.LeaseLost && err.status === 409,
  );
  job.start();
  await job.complete({ by: "b" });
  await job.finish();
  const exit = await worker.wait(10);
  assert.deepEqual(exit, { code: 0, signal: null }, worker.logText());
  // Its refused heartbeat (or complete) was the only call it made after waking: nothing accepted.
  assert.deepEqual(events.find({ kind: "complete", status: 200 }), [], JSON.stringify(events.lines));
  assert.ok(
    events.find({ kind: "heartbeat", status: 409, error: "lease_lost" }).length ||
      events.find({ kind: "complete", status: 409, error: "lease_lost" }).length,
    JSON.stringify(events.lines),
  );
  assert.deepEqual(status("frozen").result, { by: "b" });
});

it("SIGTERM releases the running job with its latest checkpoint and the worker exits 0", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("term", queue, { payload: { steps: 100, stepSeconds: 0.1 }, lease: 6 });
  const sidecar = await procs.sidecar(queue, "term");
  const [worker, events] = stepsWorker(procs, "term-worker", sidecar, "release");
  await events.wait("the job started", { kind: "started" });
  await events.wait("a heartbeat with a checkpoint", { kind: "heartbeat", status: 200 });
  await sleep(500);
  worker.signal("SIGTERM");
  assert.deepEqual(await worker.wait(10), { code: 0, signal: null }, worker.logText());
  assert.equal(events.find({ kind: "release", status: 200 }).length, 1, JSON.stringify(events.lines));
  const s = status("term");
  assert.deepEqual([s.phase, s.attempt], ["Queued", 1]);
  const job = await claimOne(new Client(sidecar.base));
  // The release sent the last checkpoint first: nothing done was lost.
  const sent = events.find({ kind: "heartbeat", status: 200 }).map((e) => e.checkpoint).filter(Boolean);
  assert.deepEqual(job.checkpoint, sent.at(-1));
  assert.ok(job.checkpoint.step >= 5, JSON.stringify(job.checkpoint));
  job.start();
  await job.complete();
  await job.finish();
});

it("SIGTERM with onShutdown finish lets the running job complete and claims nothing more", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("finish", queue, { payload: { steps: 8, stepSeconds: 0.2 }, lease: 6 });
  createJob("finish-next", queue, { payload: { steps: 1, stepSeconds: 0 }, lease: 6, priority: -1 });
  const sidecar = await procs.sidecar(queue, "finish");
  const [worker, events] = stepsWorker(procs, "finish-worker", sidecar, "finish");
  await events.wait("the job started", { kind: "started", name: "finish" });
  worker.signal("SIGTERM");
  assert.deepEqual(await worker.wait(15), { code: 0, signal: null }, worker.logText());
  assert.ok(events.find({ kind: "complete", status: 200, name: "finish" }).length, JSON.stringify(events.lines));
  assert.deepEqual(status("finish").result, { steps: 8, attempt: 1 });
  assert.equal(status("finish-next").phase, "Queued");
});

it("a draining sidecar (SIGTERM) ends the worker with exit 0 and one line", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("drain", queue, { payload: { steps: 10, stepSeconds: 0.2 }, lease: 6 });
  const sidecar = await procs.sidecar(queue, "drain");
  // Concurrency 2: one job runs while the other slot waits in a claim's long poll.
  const [worker, events] = stepsWorker(procs, "drain-worker", sidecar, "release", ["--concurrency", "2"]);
  await events.wait("the job started", { kind: "started" });
  await sleep(300);
  sidecar.signal("SIGTERM");
  // The waiting claim is answered shutting_down; the held job's result is still taken.
  assert.deepEqual(await worker.wait(20), { code: 0, signal: null }, worker.logText());
  assert.ok(events.find({ kind: "complete", status: 200, name: "drain" }).length, JSON.stringify(events.lines));
  assert.equal(status("drain").phase, "Succeeded");
  const lines = worker.stderr.split("\n").filter(Boolean);
  const shutting = lines.filter((line) => /shutting down/i.test(line));
  assert.equal(shutting.length, 1, worker.stderr);
  assert.match(shutting[0], /The sidecar is shutting down: claiming nothing more; handled 1 job\(s\)$/);
  assert.deepEqual(lines.filter((line) => / (WARNING|ERROR) /.test(line)), [], worker.stderr);
  assert.deepEqual((await sidecar.wait(15)).code, 0, sidecar.logText());
});

it("a worker with concurrency 4 completes its jobs four at a time through one sidecar", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  const names = Array.from({ length: 8 }, (_, i) => `conc-${i}`);
  for (const name of names) createJob(name, queue, { payload: { steps: 6, stepSeconds: 0.25 }, lease: 6 });
  const sidecar = await procs.sidecar(queue, "conc");
  const [worker, events] = stepsWorker(procs, "conc-worker", sidecar, "release", ["--concurrency", "4", "--max-jobs", "8"]);
  assert.deepEqual(await worker.wait(40), { code: 0, signal: null }, worker.logText());
  for (const name of names) {
    const s = status(name);
    assert.deepEqual([s.phase, s.result], ["Succeeded", { steps: 6, attempt: 1 }], name);
  }
  // Four ran at once: the fifth started only after the first four.
  const order = events.lines.filter((e) => e.kind === "started" || (e.kind === "complete" && e.status === 200));
  const firstDone = order.findIndex((e) => e.kind === "complete");
  assert.equal(firstDone, 4, JSON.stringify(order));
});

it("the example worker completes a word count and a digest, resumable from its checkpoints", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  const file = join(HERE, "..", "package.json");
  createJob("ex-words", queue, { payload: { task: "wordcount", file, chunkBytes: 64 }, lease: 6 });
  createJob("ex-sha", queue, { payload: { task: "sha256", file, chunkBytes: 100 }, lease: 6 });
  createJob("ex-bad", queue, { payload: { task: "nonsense" }, lease: 6 });
  const sidecar = await procs.sidecar(queue, "example");
  const worker = procs.start("example-worker", process.execPath, [join(HERE, "..", "examples", "worker.mjs")], {
    env: { LEASEHOLD_SIDECAR: sidecar.base, LEASEHOLD_EXIT_WHEN_IDLE: "1", LEASEHOLD_WAIT: "2", LEASEHOLD_CONCURRENCY: "2" },
  });
  assert.deepEqual(await worker.wait(40), { code: 0, signal: null }, worker.logText());
  const { readFileSync } = await import("node:fs");
  const { createHash } = await import("node:crypto");
  const text = readFileSync(file);
  const words = status("ex-words");
  assert.equal(words.phase, "Succeeded", JSON.stringify(words));
  assert.deepEqual(words.result, {
    task: "wordcount",
    bytes: text.length,
    lines: text.toString().split("\n").length - 1,
    words: text.toString().split(/\s+/).filter(Boolean).length,
  });
  const sha = status("ex-sha");
  assert.equal(sha.result.sha256, createHash("sha256").update(text).digest("hex"));
  const bad = status("ex-bad");
  assert.deepEqual([bad.phase, bad.failures[0].reason], ["Failed", "BadPayload"]);
});

it("every error code the sidecar answers is its typed error, and bad input is refused before sending", async (t) => {
  const queue = queueFor(t);
  const procs = procsFor(t);
  createJob("errors", queue, { lease: 10 });
  const sidecar = await procs.sidecar(queue, "errors");
  const client = new Client(sidecar.base);
  await assert.rejects(client.claim(301), (e) => e instanceof leasehold.InvalidRequest && e.status === 400 && /wait/.test(e.serverMessage));
  const job = await claimOne(client);
  await assert.rejects(client.heartbeat("errors", "not-a-token"), leasehold.InvalidToken);
  await assert.rejects(client.heartbeat("no-such-job", job.token), (e) => e instanceof leasehold.JobNotFound && e instanceof leasehold.JobLost && /no-such-job/.test(e.serverMessage));
  await assert.rejects(client.heartbeat("Not_A_Name", job.token), leasehold.InvalidName);
  await assert.rejects(
    client.heartbeat("errors", job.token, { progress: 2 }),
    (e) => e instanceof leasehold.InvalidRequest && e.serverMessage.startsWith("progress 2 is out of range"),
  );
  await assert.rejects(client.jobCall("complete", "errors", { token: job.token, result: 1, extra: true }), leasehold.InvalidJson);
  await assert.rejects(client.jobCall("frobnicate", "errors", { token: job.token }), leasehold.NotFound);
  await assert.rejects(client.heartbeat("errors", `1.${"0".repeat(32)}`), (e) => e instanceof leasehold.LeaseLost && e.status === 409);
  // Refused here, before the sidecar would.
  await assert.rejects(client.complete("errors", job.token, "x".repeat(1024 * 1024)), leasehold.TooLarge);
  assert.throws(() => job.save("y".repeat(64 * 1024 + 1)), leasehold.TooLarge);
  assert.throws(() => job.progress(1.5), leasehold.InvalidRequest);
  assert.throws(() => job.progress(0.5, "m".repeat(257)), /at most 256 bytes/);
  await assert.rejects(job.fail("not camel case!", "x"), /CamelCase/);
  await assert.rejects(job.fail("Later", "x", { retryable: true, retryAfterSeconds: 90000 }), /retryAfterSeconds/);
  await assert.rejects(job.complete(new Map()), /object of type Map is not JSON/);
  job.start();
  await job.complete({ ok: true });
  await job.finish();
  await assert.rejects(client.complete("errors", job.token, { again: true }), leasehold.JobFinished);
  // A draining sidecar refuses claims but still serves the job it holds, then exits.
  createJob("errors-held", queue, { lease: 10 });
  const held = await claimOne(client);
  sidecar.signal("SIGTERM");
  await assert.rejects(
    waitUntil("a draining sidecar", 5, () => client.claim(0)),
    (e) => e instanceof leasehold.ShuttingDown && e.status === 503,
  );
  await held.complete({ ok: true });
  assert.equal((await sidecar.wait(10)).code, 0);
  await assert.rejects(client.claim(0), leasehold.ConnectionFailed);
});
