// Unit tests of the client's own logic against a local stub of the sidecar (node:http): the
// error classes, input checks, retries with the same token, lease loss, the worker's outcomes,
// and the claim's newer fields (maxAttempts, failures, lastAttempt) and fail's
// retryAfterSeconds, which the sidecar of this tree does not send or take yet.

import assert from "node:assert/strict";
import { getEventListeners } from "node:events";
import { createServer } from "node:http";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import * as leasehold from "../dist/index.js";

const {
  Client, Job, Worker, Fail, ERRORS, whyNotJson, silentLogger,
} = leasehold;

const TOKEN = `1.${"a".repeat(32)}`;

/**
 * A stub sidecar: `route(req, body)` returns [status, body] (or a promise of it); every
 * request is recorded as {path, body}.
 */
async function stub(t, route) {
  const requests = [];
  const server = createServer((req, res) => {
    let raw = "";
    req.setEncoding("utf8");
    req.on("data", (chunk) => (raw += chunk));
    req.on("end", async () => {
      const body = raw ? JSON.parse(raw) : undefined;
      requests.push({ path: req.url, body });
      const [status, answer] = await route(req.url, body, requests.length);
      res.writeHead(status, { "content-type": "application/json" });
      res.end(answer === undefined ? "" : JSON.stringify(answer));
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  t.after(() => new Promise((resolve) => server.close(resolve)));
  server.closeIdleConnections?.();
  return { base: `http://127.0.0.1:${server.address().port}`, requests };
}

function claim(fields = {}) {
  return {
    namespace: "ns",
    name: "job-1",
    attempt: 1,
    token: TOKEN,
    payload: { n: 1 },
    leaseDurationSeconds: 6,
    checkpoint: null,
    ...fields,
  };
}

function ended(phase = "Succeeded") {
  return [200, { namespace: "ns", name: "job-1", attempt: 1, phase }];
}

function beat() {
  return [200, { renewTime: "t", expiresAt: "t", leaseDurationSeconds: 6 }];
}

/** A logger that keeps its lines. */
function memoryLogger() {
  const lines = [];
  return {
    lines,
    info: (m) => lines.push(["info", m]),
    warn: (m) => lines.push(["warn", m]),
    error: (m) => lines.push(["error", m]),
  };
}

test("every documented error code is its own class, grouped as the protocol groups them", async (t) => {
  const here = dirname(fileURLToPath(import.meta.url));
  const docs = process.env.LEASEHOLD_REPO_ROOT ?? join(here, "..", "..", "..");
  const table = readFileSync(join(docs, "docs", "protocol.md"), "utf8");
  const documented = new Set([...table.matchAll(/^\| \d{3} \| `([a-z_]+)` \|/gm)].map((m) => m[1]));
  assert.ok(documented.size >= 14);
  assert.deepEqual([...documented].sort(), Object.keys(ERRORS).sort());
  const groups = {
    lease_lost: leasehold.JobLost, cancelled: leasehold.JobLost, job_finished: leasehold.JobLost,
    job_not_found: leasehold.JobLost, invalid_request: leasehold.RequestRejected,
    invalid_json: leasehold.RequestRejected, invalid_token: leasehold.RequestRejected,
    too_large: leasehold.RequestRejected, unavailable: leasehold.Unavailable,
    shutting_down: leasehold.ShuttingDown,
  };
  for (const [code, group] of Object.entries(groups)) {
    const err = leasehold.errorFromAnswer(409, { error: code, message: `m ${code}` });
    assert.ok(err instanceof group, code);
    assert.ok(err instanceof Error && err instanceof leasehold.LeaseholdError);
    assert.equal(err.code, code);
    assert.equal(err.serverMessage, `m ${code}`);
    assert.equal(err.name, ERRORS[code].name);
  }
  assert.ok(new leasehold.LeaseUnconfirmed("x") instanceof leasehold.JobLost);
  const unknown = leasehold.errorFromAnswer(418, { error: "teapot", message: "short and stout" });
  assert.ok(unknown instanceof leasehold.UnexpectedResponse);
  assert.equal(unknown.code, "teapot");
  const garbled = leasehold.errorFromAnswer(502, { raw: "<html>" });
  assert.ok(garbled instanceof leasehold.UnexpectedResponse);
  assert.equal(garbled.code, "");
  const unavailable = leasehold.errorFromAnswer(503, { error: "unavailable", message: "m", expiresAt: "2030-01-01T00:00:00Z" });
  assert.equal(unavailable.expiresAt, "2030-01-01T00:00:00Z");
});

test("the claim's newer fields are surfaced on the job when present, and absent otherwise", async (t) => {
  const failures = [{ attempt: 1, holder: "pod-a", reason: "WorkerError", message: "disk full", time: "2030-01-01T00:00:00Z" }];
  let answer = claim({ attempt: 2, maxAttempts: 3, failures, lastAttempt: false });
  const sidecar = await stub(t, (path) => (path.startsWith("/v1/claim") ? [200, answer] : beat()));
  const client = new Client(sidecar.base);
  const job = await Job.claim(client, 1, { logger: silentLogger });
  assert.equal(sidecar.requests[0].path, "/v1/claim?wait=1");
  assert.equal(job.maxAttempts, 3);
  assert.deepEqual(job.failures, failures);
  assert.equal(job.lastAttempt, false);
  assert.equal(job.label, "ns/job-1");
  answer = claim();
  const old = await Job.claim(client, 0);
  assert.equal(old.maxAttempts, undefined);
  assert.equal(old.failures, undefined);
  assert.equal(old.lastAttempt, undefined);
  assert.equal(old.checkpoint, null);
  assert.equal(old.heartbeatInterval, 2);
});

test("a claim that finds nothing is null; one aborted by its signal is a ConnectionFailed", async (t) => {
  const sidecar = await stub(t, async (path) => {
    if (path === "/v1/claim?wait=0") return [204, undefined];
    await new Promise((resolve) => setTimeout(resolve, 2000));
    return [204, undefined];
  });
  const client = new Client(sidecar.base);
  assert.equal(await client.claim(0), null);
  const abort = new AbortController();
  setTimeout(() => abort.abort(), 50);
  await assert.rejects(client.claim(5, { signal: abort.signal }), leasehold.ConnectionFailed);
});

test("fail sends retryAfterSeconds only when given, and checks it and the reason before sending", async (t) => {
  const sidecar = await stub(t, () => ended("Queued"));
  const client = new Client(sidecar.base);
  await client.fail("job-1", TOKEN, "RateLimited", "429 from upstream", { retryable: true, retryAfterSeconds: 120 });
  await client.fail("job-1", TOKEN, "BadInput", "no");
  assert.deepEqual(sidecar.requests.map((r) => r.body), [
    { token: TOKEN, reason: "RateLimited", message: "429 from upstream", retryable: true, retryAfterSeconds: 120 },
    { token: TOKEN, reason: "BadInput", message: "no", retryable: false },
  ]);
  const refused = [
    ["not camel case!", {}, /reason "not camel case!" is not a CamelCase word/],
    ["9Lives", {}, /CamelCase/],
    ["A".repeat(65), {}, /at most 64 characters/],
    ["Slow", { retryable: true, retryAfterSeconds: 86401 }, /retryAfterSeconds 86401 is out of range/],
    ["Slow", { retryable: true, retryAfterSeconds: -1 }, /out of range/],
    ["Slow", { retryable: true, retryAfterSeconds: 1.5 }, /whole number/],
    ["Slow", { retryable: false, retryAfterSeconds: 10 }, /not retryable/],
  ];
  for (const [reason, options, says] of refused) {
    await assert.rejects(client.fail("job-1", TOKEN, reason, "m", options), (err) => {
      assert.ok(err instanceof leasehold.InvalidRequest, String(err));
      assert.match(err.message, says);
      return true;
    });
  }
  assert.equal(sidecar.requests.length, 2, "nothing refused was sent");
  // A long message is cut at a character boundary, under 4096 bytes.
  await client.fail("job-1", TOKEN, "Long", "é".repeat(3000));
  const sent = sidecar.requests[2].body.message;
  assert.equal(Buffer.byteLength(sent), 4096);
  assert.equal(sent, "é".repeat(2048));
});

test("save and progress refuse what the sidecar would, naming the rule", async (t) => {
  const sidecar = await stub(t, () => beat());
  const job = new Job(new Client(sidecar.base), claim(), { logger: silentLogger });
  for (const [fraction, message] of [[1.5], [-0.1], ["half"], [Number.NaN], [0.5, "x".repeat(257)], [0.5, "two\nlines"], [0.5, 7]]) {
    assert.throws(() => job.progress(fraction, message), leasehold.InvalidRequest, `${fraction} ${message}`);
  }
  assert.throws(() => job.progress(2), /progress 2 is out of range: expected a number from 0 to 1/);
  assert.throws(() => job.progress(0.5, "ü".repeat(129)), /message is 258 bytes: at most 256/);
  job.progress(0.5, "ü".repeat(128)); // 256 bytes: accepted
  assert.throws(() => job.save("y".repeat(64 * 1024 + 1)), leasehold.TooLarge);
  assert.throws(() => job.save(undefined), /cannot be undefined/);
  assert.throws(() => job.save(null), /cannot be null/);
  assert.throws(() => job.save({ at: new Map() }), /at \.at: an object of type Map is not JSON/);
  assert.throws(() => job.save(10n), /a bigint is not JSON/);
  job.save("y".repeat(64 * 1024 - 2)); // 64 KiB with its quotes: accepted
  assert.equal(sidecar.requests.length, 0, "nothing is sent by save or progress");
  await job.heartbeat();
  assert.equal(sidecar.requests[0].body.checkpoint.length, 64 * 1024 - 2);
  assert.equal(sidecar.requests[0].body.progress, 0.5);
  await job.heartbeat();
  assert.equal(sidecar.requests[1].body.checkpoint, undefined, "a checkpoint is sent once");
  assert.equal(sidecar.requests[1].body.message, "ü".repeat(128), "progress rides on every heartbeat");
});

test("strict JSON: what whyNotJson accepts and refuses", () => {
  for (const ok of [null, 1, "s", true, [1, [2]], { a: { b: [null] } }, { skip: undefined }, new Date(0), Object.create(null)]) {
    assert.equal(whyNotJson(ok), undefined, JSON.stringify(ok));
  }
  class Transcript {}
  const cyclic = {};
  cyclic.self = cyclic;
  for (const [bad, says] of [
    [undefined, /^undefined is not JSON/],
    [Number.NaN, /NaN is not a JSON number/],
    [Infinity, /Infinity/],
    [new Transcript(), /an object of type Transcript is not JSON/],
    [[1, undefined], /at \[1\]: undefined is not JSON/],
    [{ f: () => 1 }, /at \.f: a function/],
    [new Set([1]), /Set/],
    [cyclic, /cycle/],
  ]) {
    assert.match(whyNotJson(bad) ?? "", says);
  }
});

test("an ending repeats unavailable and connection failures with the same token, then succeeds once", async (t) => {
  const sidecar = await stub(t, (path, body, n) =>
    n <= 2 ? [503, { error: "unavailable", message: "the API server did not answer", expiresAt: "x" }] : ended(),
  );
  const recorder = [];
  const job = new Job(new Client({ baseUrl: sidecar.base, onEvent: (e) => recorder.push(e) }), claim(), { logger: silentLogger });
  const answer = await job.complete({ words: 3 });
  assert.equal(answer.phase, "Succeeded");
  assert.equal(job.ended, "complete");
  assert.deepEqual(sidecar.requests.map((r) => r.body), Array(3).fill({ token: TOKEN, result: { words: 3 } }));
  assert.deepEqual(recorder.map((e) => [e.kind, e.status, e.error]), [
    ["complete", 503, "unavailable"], ["complete", 503, "unavailable"], ["complete", 200, undefined],
  ]);
  assert.ok(job.signal.aborted && job.signal.reason instanceof leasehold.JobEnded);
  await assert.rejects(job.complete("again"), leasehold.JobEnded);
  await assert.rejects(job.release(), leasehold.JobEnded);
  assert.equal(sidecar.requests.length, 3);
});

test("a lost lease aborts job.signal with the reason, and nothing is sent after it", async (t) => {
  const sidecar = await stub(t, (path) =>
    path.endsWith("/heartbeat") ? [409, { error: "lease_lost", message: "job-1 is held by attempt 2" }] : ended(),
  );
  const job = new Job(new Client(sidecar.base), claim({ leaseDurationSeconds: 1 }), { logger: silentLogger });
  job.start();
  const reason = await new Promise((resolve) => job.signal.addEventListener("abort", () => resolve(job.signal.reason)));
  assert.ok(reason instanceof leasehold.LeaseLost);
  assert.equal(reason.status, 409);
  assert.equal(job.lost, reason);
  assert.throws(() => job.check(), leasehold.LeaseLost);
  await assert.rejects(job.sleep(10), leasehold.LeaseLost);
  await assert.rejects(job.complete("late"), leasehold.LeaseLost);
  await assert.rejects(job.fail("Late", "late"), leasehold.LeaseLost);
  await job.finish();
  assert.deepEqual(sidecar.requests.map((r) => r.path), ["/v1/jobs/job-1/heartbeat"]);
});

test("no heartbeat confirmed for a whole lease: LeaseUnconfirmed, no result, a release", async (t) => {
  const sidecar = await stub(t, (path) =>
    path.endsWith("/heartbeat") ? [503, { error: "unavailable", message: "slow API server" }] : ended("Queued"),
  );
  const job = new Job(new Client(sidecar.base), claim({ leaseDurationSeconds: 1 }), { logger: silentLogger });
  job.start();
  const started = performance.now();
  const reason = await new Promise((resolve) => job.signal.addEventListener("abort", () => resolve(job.signal.reason)));
  const seconds = (performance.now() - started) / 1000;
  assert.ok(reason instanceof leasehold.LeaseUnconfirmed, String(reason));
  assert.ok(seconds >= 0.9 && seconds < 4, `${seconds}`);
  assert.match(reason.message, /whole lease/);
  await assert.rejects(job.complete("late"), leasehold.LeaseUnconfirmed);
  await job.finish({ error: reason });
  const paths = sidecar.requests.map((r) => r.path);
  assert.ok(!paths.some((p) => p.endsWith("/complete")), paths.join());
  assert.equal(paths.at(-1), "/v1/jobs/job-1/release");
  assert.equal(job.ended, "release");
});

test("a finished job leaves no listener on the worker's long-lived shutdown signal", async (t) => {
  const sidecar = await stub(t, () => ended());
  const shutdown = new AbortController();
  for (let i = 0; i < 3; i++) {
    const job = new Job(new Client(sidecar.base), claim(), { shutdown: shutdown.signal, logger: silentLogger });
    job.start();
    await job.complete(i);
    await job.finish();
  }
  assert.equal(getEventListeners(shutdown.signal, "abort").length, 0);
});

test("a release sends the checkpoint saved since the last heartbeat first", async (t) => {
  const sidecar = await stub(t, (path) => (path.endsWith("/heartbeat") ? beat() : ended("Queued")));
  const job = new Job(new Client(sidecar.base), claim(), { logger: silentLogger });
  job.save({ offset: 8192 });
  await job.release();
  assert.deepEqual(sidecar.requests.map((r) => [r.path, r.body]), [
    ["/v1/jobs/job-1/heartbeat", { token: TOKEN, checkpoint: { offset: 8192 } }],
    ["/v1/jobs/job-1/release", { token: TOKEN }],
  ]);
});

/** A stub with `jobs` to claim (one per claim, then 204); records endings by job. */
async function queueStub(t, jobs, { afterJobs } = {}) {
  const queue = [...jobs];
  const endings = [];
  const sidecar = await stub(t, async (path, body) => {
    if (path.startsWith("/v1/claim")) {
      const next = queue.shift();
      if (next) return [200, next];
      if (afterJobs) return afterJobs();
      await new Promise((resolve) => setTimeout(resolve, 100));
      return [204, undefined];
    }
    const [, name, verb] = path.match(/^\/v1\/jobs\/([^/]+)\/(\w+)$/);
    if (verb === "heartbeat") return beat();
    endings.push({ name, verb, ...body });
    return ended(verb === "complete" ? "Succeeded" : "Queued");
  });
  return { sidecar, endings };
}

test("the worker ends each attempt as its handler's outcome says", async (t) => {
  const names = ["returns", "undefined", "fails", "retries-later", "throws", "map", "bigint", "bad-fail"];
  const { sidecar, endings } = await queueStub(t, names.map((name) => claim({ name, token: `1.${name}` })));
  class Bug extends Error {}
  const handlers = {
    returns: () => ({ ok: true }),
    undefined: async () => {},
    fails: () => {
      throw new Fail("BadInput", "payload.x: missing");
    },
    "retries-later": async () => {
      throw new Fail("RateLimited", "upstream said 429", { retryable: true, retryAfterSeconds: 30 });
    },
    throws: async () => {
      throw new Bug("disk full");
    },
    map: () => new Map([[1, 2]]),
    bigint: () => ({ n: 10n }),
    "bad-fail": () => {
      throw new Fail("not a reason", "oops");
    },
  };
  const log = memoryLogger();
  const worker = new Worker((job) => handlers[job.name](job), {
    client: new Client(sidecar.base), wait: 1, exitWhenIdle: true, handleSignals: false, logger: log,
  });
  assert.equal(await worker.run(), names.length);
  const by = Object.fromEntries(endings.map((e) => [e.name, e]));
  assert.deepEqual(by.returns, { name: "returns", verb: "complete", token: "1.returns", result: { ok: true } });
  assert.equal(by.undefined.verb, "complete");
  assert.equal(by.undefined.result, null);
  assert.deepEqual([by.fails.verb, by.fails.reason, by.fails.retryable, by.fails.retryAfterSeconds], ["fail", "BadInput", false, undefined]);
  assert.equal(by.fails.message, "payload.x: missing");
  assert.deepEqual(
    [by["retries-later"].reason, by["retries-later"].retryable, by["retries-later"].retryAfterSeconds],
    ["RateLimited", true, 30],
  );
  assert.deepEqual([by.throws.reason, by.throws.retryable, by.throws.message], ["WorkerError", true, "Error: disk full"]);
  assert.deepEqual([by.map.reason, by.map.retryable], ["ResultNotJSON", false]);
  assert.match(by.map.message, /the handler's result of type Map is not JSON/);
  assert.match(by.bigint.message, /result of type Object is not JSON: at \.n: a bigint is not JSON/);
  assert.deepEqual([by["bad-fail"].reason, by["bad-fail"].retryable], ["WorkerError", true]);
  assert.match(by["bad-fail"].message, /invalid Fail: reason "not a reason"/);
  assert.equal(endings.length, names.length, "one ending per attempt");
  assert.ok(log.lines.some(([level, line]) => level === "error" && line.includes("Handler failed on ns/throws")));
});

test("a worker with concurrency 4 runs four jobs at once through one sidecar, never more", async (t) => {
  const jobs = Array.from({ length: 12 }, (_, i) => claim({ name: `c${i}`, token: `1.c${i}` }));
  const { sidecar, endings } = await queueStub(t, jobs);
  let now = 0;
  let most = 0;
  const worker = new Worker(
    async (job) => {
      now += 1;
      most = Math.max(most, now);
      await new Promise((resolve) => setTimeout(resolve, 150));
      now -= 1;
      return job.name;
    },
    { client: new Client(sidecar.base), wait: 1, concurrency: 4, exitWhenIdle: true, handleSignals: false, logger: silentLogger },
  );
  assert.equal(await worker.run(), 12);
  assert.equal(most, 4);
  assert.deepEqual(endings.map((e) => e.result).sort(), jobs.map((j) => j.name).sort());
});

test("a sidecar shutting down ends the worker at once, after its running job, with one line", async (t) => {
  const { sidecar, endings } = await queueStub(t, [claim({ name: "last" })], {
    afterJobs: () => [503, { error: "shutting_down", message: "the sidecar is shutting down" }],
  });
  const log = memoryLogger();
  const worker = new Worker(
    async () => {
      await new Promise((resolve) => setTimeout(resolve, 200));
      return "done";
    },
    { client: new Client(sidecar.base), wait: 1, handleSignals: false, logger: log },
  );
  const guard = setTimeout(() => worker.stop(), 5000); // a regression would retry forever
  const started = performance.now();
  assert.equal(await worker.run(), 1);
  clearTimeout(guard);
  assert.ok(performance.now() - started < 2000);
  assert.deepEqual(endings.map((e) => [e.name, e.verb]), [["last", "complete"]]);
  const shutting = log.lines.filter(([, line]) => line.includes("shutting"));
  assert.deepEqual(shutting, [["info", "The sidecar is shutting down: claiming nothing more; handled 1 job(s)"]]);
  assert.deepEqual(log.lines.filter(([level]) => level !== "info"), []);
});

test("stop() with the release policy aborts the running job's signal and releases it with its checkpoint", async (t) => {
  const { sidecar, endings } = await queueStub(t, [claim({ name: "long" })]);
  let worker;
  worker = new Worker(
    async (job) => {
      job.save({ step: 3 });
      setTimeout(() => worker.stop(), 50);
      await new Promise((resolve, reject) => {
        job.signal.addEventListener("abort", () => reject(job.signal.reason));
      });
    },
    { client: new Client(sidecar.base), wait: 1, handleSignals: false, logger: silentLogger },
  );
  assert.equal(await worker.run(), 1);
  assert.deepEqual(endings.map((e) => [e.name, e.verb]), [["long", "release"]]);
  const beats = sidecar.requests.filter((r) => r.path.endsWith("/heartbeat"));
  assert.deepEqual(beats.at(-1).body.checkpoint, { step: 3 });
});

test("bad handlers and options are refused when the worker is made", () => {
  const client = new Client("http://127.0.0.1:9");
  for (const [handler, says] of [
    [42, /handler must be a function/],
    ["handle", /handler must be a function/],
    [function* steps() {}, /is a generator function/],
    [async function* steps() {}, /is a generator function/],
  ]) {
    assert.throws(() => new Worker(handler, { client }), says);
  }
  assert.throws(() => new Worker(() => 1, { client, wait: 301 }), RangeError);
  assert.throws(() => new Worker(() => 1, { client, concurrency: 0 }), /concurrency/);
  assert.throws(() => new Worker(() => 1, { client, onShutdown: "panic" }), /onShutdown/);
  assert.throws(() => new Client("ftp://x"), /expected http:\/\/HOST:PORT/);
  assert.equal(leasehold.VERSION, JSON.parse(readFileSync(new URL("../package.json", import.meta.url))).version);
});

test("a body over 1 MiB is refused before it is sent", async (t) => {
  const sidecar = await stub(t, () => ended());
  await assert.rejects(new Client(sidecar.base).complete("job-1", TOKEN, "x".repeat(1024 * 1024)), leasehold.TooLarge);
  assert.equal(sidecar.requests.length, 0);
});

// ---- traces across the queue (tracing.ts), with OpenTelemetry's API and SDK from the dev
// dependencies; and without them, in a process that cannot import them.

const TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID = "00f067aa0ba902b7";
const TRACEPARENT = `00-${TRACE_ID}-${PARENT_ID}-01`;

let otelSetUp;
/** The SDK, set up once for this process: an in-memory exporter, an AsyncLocalStorage context manager. */
async function otel() {
  otelSetUp ??= (async () => {
    const api = await import("@opentelemetry/api");
    const sdk = await import("@opentelemetry/sdk-trace-base");
    const { AsyncLocalStorageContextManager } = await import("@opentelemetry/context-async-hooks");
    const exporter = new sdk.InMemorySpanExporter();
    const provider = new sdk.BasicTracerProvider({ spanProcessors: [new sdk.SimpleSpanProcessor(exporter)] });
    assert.ok(api.trace.setGlobalTracerProvider(provider));
    api.context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
    return { api, exporter };
  })();
  const setUp = await otelSetUp;
  setUp.exporter.reset();
  return setUp;
}

/** Runs `handler` on the stub's jobs; returns the endings and the job spans by job name. */
async function traced(t, jobs, handler) {
  const { exporter } = await otel();
  const { sidecar, endings } = await queueStub(t, jobs);
  const worker = new Worker(handler, {
    client: new Client(sidecar.base), wait: 0, exitWhenIdle: true, handleSignals: false, logger: silentLogger,
  });
  await worker.run();
  const spans = Object.fromEntries(
    exporter.getFinishedSpans().filter((s) => s.name.startsWith("leasehold.job")).map((s) => [s.attributes["messaging.message.id"], s]),
  );
  return { endings, spans };
}

test("the handler runs in a span parented on the producer's traceparent", async (t) => {
  const { api } = await otel();
  const seen = {};
  const { endings, spans } = await traced(
    t,
    [claim({ name: "a", queue: "media", attempt: 2, traceparent: TRACEPARENT, tracestate: "rojo=00f067aa0ba902b7" })],
    async (job) => {
      await new Promise((resolve) => setTimeout(resolve, 5));
      seen.traceparent = job.traceparent;
      seen.active = api.trace.getActiveSpan()?.spanContext();
      return "ok";
    },
  );
  assert.deepEqual(endings.map((e) => e.verb), ["complete"]);
  assert.equal(seen.traceparent, TRACEPARENT);
  const span = spans.a;
  assert.equal(span.name, "leasehold.job media");
  assert.equal(span.kind, api.SpanKind.CONSUMER);
  assert.equal(span.spanContext().traceId, TRACE_ID);
  assert.equal(span.parentSpanContext.spanId, PARENT_ID);
  assert.equal(span.parentSpanContext.isRemote, true);
  // No propagator is registered: the client parsed the traceparent itself, tracestate too.
  assert.equal(span.spanContext().traceState?.get("rojo"), "00f067aa0ba902b7");
  assert.equal(seen.active.spanId, span.spanContext().spanId, "the span is current in the handler");
  assert.deepEqual({ ...span.attributes }, {
    "messaging.system": "leasehold",
    "messaging.operation.type": "process",
    "messaging.destination.name": "media",
    "messaging.message.id": "a",
    "leasehold.namespace": "ns",
    "leasehold.attempt": 2,
    "leasehold.outcome": "complete",
  });
  assert.equal(span.status.code, api.SpanStatusCode.UNSET);
});

test("a registered W3C propagator extracts the parent", async (t) => {
  const { api } = await otel();
  const { W3CTraceContextPropagator } = await import("@opentelemetry/core");
  const w3c = new W3CTraceContextPropagator();
  const carriers = [];
  api.propagation.setGlobalPropagator({
    inject: (...args) => w3c.inject(...args),
    extract: (context, carrier, getter) => {
      carriers.push({ ...carrier });
      return w3c.extract(context, carrier, getter);
    },
    fields: () => w3c.fields(),
  });
  t.after(() => api.propagation.disable());
  const { spans } = await traced(t, [claim({ name: "a", traceparent: TRACEPARENT, tracestate: "congo=t61" })], () => null);
  assert.deepEqual(carriers, [{ traceparent: TRACEPARENT, tracestate: "congo=t61" }]);
  assert.equal(spans.a.name, "leasehold.job a", "named after the job when the sidecar does not say its queue");
  assert.equal(spans.a.spanContext().traceId, TRACE_ID);
  assert.equal(spans.a.parentSpanContext.spanId, PARENT_ID);
  assert.equal(spans.a.spanContext().traceState?.get("congo"), "t61");
});

test("a failed attempt records the exception and an error status; a handed-back one does not", async (t) => {
  const { api } = await otel();
  const { endings, spans } = await traced(
    t,
    [claim({ name: "fails", traceparent: TRACEPARENT }), claim({ name: "map", token: `1.${"b".repeat(32)}` }),
      claim({ name: "back", token: `1.${"c".repeat(32)}` })],
    (job) => {
      if (job.name === "fails") throw new Fail("BadInput", "no such file");
      if (job.name === "back") throw new leasehold.ShutdownRequested("stopping");
      return new Map();
    },
  );
  assert.deepEqual(endings.map((e) => [e.name, e.verb]), [["fails", "fail"], ["map", "fail"], ["back", "release"]]);
  assert.equal(spans.fails.status.code, api.SpanStatusCode.ERROR);
  assert.match(spans.fails.status.message, /no such file/);
  assert.equal(spans.fails.events.filter((e) => e.name === "exception").length, 1);
  assert.equal(spans.fails.attributes["leasehold.outcome"], "fail");
  assert.equal(spans.map.status.code, api.SpanStatusCode.ERROR, "a result that is not JSON fails the attempt");
  assert.equal(spans.back.status.code, api.SpanStatusCode.UNSET);
  assert.equal(spans.back.attributes["leasehold.outcome"], "release");
});

test("without a valid traceparent the span is a root", async (t) => {
  const { api } = await otel();
  const bad = [undefined, `00-${TRACE_ID.toUpperCase()}-${PARENT_ID}-01`, `00-${"0".repeat(32)}-${PARENT_ID}-01`, "01-x"];
  const jobs = bad.map((traceparent, i) => claim({ name: `j${i}`, token: `1.${String(i).repeat(32)}`, traceparent }));
  const outer = api.trace.getTracer("test").startSpan("outer");
  const { spans } = await api.context.with(api.trace.setSpan(api.context.active(), outer), () => traced(t, jobs, () => null));
  outer.end();
  assert.equal(Object.keys(spans).length, bad.length);
  for (const span of Object.values(spans)) {
    assert.equal(span.parentSpanContext, undefined, span.name);
    assert.notEqual(span.spanContext().traceId, TRACE_ID);
  }
  assert.equal(leasehold.parseTraceparent(TRACEPARENT).traceId, TRACE_ID);
  for (const value of bad) assert.equal(leasehold.parseTraceparent(value), undefined, value);
});

test("without @opentelemetry/api the worker runs its handlers unchanged", async (t) => {
  const { sidecar, endings } = await queueStub(t, [claim({ name: "a", traceparent: TRACEPARENT })]);
  // A process in which importing any @opentelemetry package fails, as when none is installed.
  const hooks = `export async function resolve(specifier, context, next) {
    if (specifier.startsWith("@opentelemetry/")) {
      throw Object.assign(new Error("Cannot find package " + specifier), { code: "ERR_MODULE_NOT_FOUND" });
    }
    return next(specifier, context);
  }`;
  const register = `import { register } from "node:module"; register(${JSON.stringify(`data:text/javascript,${encodeURIComponent(hooks)}`)});`;
  const index = new URL("../dist/index.js", import.meta.url).href;
  const script = `
    const leasehold = await import(${JSON.stringify(index)});
    await assert.rejects(import("@opentelemetry/api"));
    await new leasehold.Worker((job) => ({ traceparent: job.traceparent }), {
      client: new leasehold.Client(${JSON.stringify(sidecar.base)}), wait: 0, exitWhenIdle: true,
      handleSignals: false, logger: leasehold.silentLogger,
    }).run();`;
  const { execFile } = await import("node:child_process");
  const out = await new Promise((resolve) => {
    execFile(
      process.execPath,
      ["--import", `data:text/javascript,${encodeURIComponent(register)}`, "--input-type=module", "-e",
        `import assert from "node:assert/strict"; ${script}`],
      (error, stdout, stderr) => resolve({ error, stdout, stderr }),
    );
  });
  assert.equal(out.error, null, out.stderr);
  assert.deepEqual(endings.map((e) => [e.verb, e.result]), [["complete", { traceparent: TRACEPARENT }]]);
});
