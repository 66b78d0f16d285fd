// Fixtures of the integration tests: the real leasehold sidecar as a process, jobs created and
// read with the test control plane's kubectl, worker processes whose events are JSON lines.
//
// Run from tests/typescript_client.rs (`scripts/test --test typescript_client`), which starts a
// controller for the namespace and sets:
//   LEASEHOLD_BIN               the leasehold binary
//   LEASEHOLD_TEST_NAMESPACE    the namespace (shared by these tests: each uses its own queue)
//   LEASEHOLD_KUBECTL           kubectl of the test control plane
//   KUBECONFIG                  the test control plane's kubeconfig
//   LEASEHOLD_NODE_TEST_LOGS    where the logs of the processes started here go
// Without them the integration tests are skipped (the unit tests still run).

import { spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { createWriteStream, mkdirSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";

export const NAMESPACE = process.env.LEASEHOLD_TEST_NAMESPACE;
export const LOGS = process.env.LEASEHOLD_NODE_TEST_LOGS;
/** Set (to why) when the integration tests cannot run here. */
export const SKIP =
  ["LEASEHOLD_BIN", "LEASEHOLD_TEST_NAMESPACE", "LEASEHOLD_KUBECTL", "KUBECONFIG", "LEASEHOLD_NODE_TEST_LOGS"]
    .filter((name) => !process.env[name])
    .map((name) => `${name} is not set: run with \`scripts/test --test typescript_client\``)[0] ?? false;

export function kubectl(args, stdin) {
  const done = spawnSync(process.env.LEASEHOLD_KUBECTL, ["-n", NAMESPACE, ...args], {
    input: stdin,
    encoding: "utf8",
    timeout: 30000,
  });
  if (done.status !== 0) throw new Error(`kubectl ${args.join(" ")}: ${done.stdout}${done.stderr}`);
  return done.stdout;
}

export function createJob(name, queue, { payload = {}, lease = 5, ...spec } = {}) {
  const manifest = {
    apiVersion: "leasehold.dev/v1alpha1",
    kind: "LeasedJob",
    metadata: { name },
    spec: { queue, leaseDurationSeconds: lease, payload, ...spec },
  };
  kubectl(["create", "-f", "-"], JSON.stringify(manifest));
}

export function jobObject(name) {
  return JSON.parse(kubectl(["get", "ljob", name, "-o", "json"]));
}

export function status(name) {
  return jobObject(name).status ?? {};
}

export async function waitUntil(what, timeoutSeconds, probe, everyMs = 100) {
  const deadline = Date.now() + timeoutSeconds * 1000;
  for (;;) {
    const value = await probe();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutSeconds} s waiting for ${what}`);
    await sleep(everyMs);
  }
}

export async function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** A queue of the test's own: its name and a random suffix. */
export function queueFor(t) {
  const short = t.name.toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-+/, "").slice(0, 40).replace(/-+$/, "");
  return `${short}-${randomBytes(3).toString("hex")}`;
}

/** A process started by a test; its stderr (and stdout unless piped) go to a log file. */
export class Proc {
  constructor(name, command, args, { pipeStdout = false, env = {} } = {}) {
    mkdirSync(LOGS, { recursive: true });
    this.name = name;
    this.logPath = join(LOGS, `${name}.log`);
    this.log = createWriteStream(this.logPath);
    this.child = spawn(command, args, {
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, ...env },
    });
    this.stderr = "";
    this.child.stderr.on("data", (chunk) => {
      this.stderr += chunk;
      this.log.write(chunk);
    });
    if (!pipeStdout) this.child.stdout.pipe(this.log, { end: false });
    this.exited = new Promise((resolve) => this.child.on("exit", (code, signal) => resolve({ code, signal })));
    this.exit = undefined;
    this.exited.then((exit) => (this.exit = exit));
  }

  signal(name) {
    this.child.kill(name);
  }

  async wait(timeoutSeconds) {
    const timer = sleep(timeoutSeconds * 1000).then(() => {
      throw new Error(`${this.name} did not exit within ${timeoutSeconds} s:\n${this.logText()}`);
    });
    return Promise.race([this.exited, timer]);
  }

  logText() {
    try {
      return readFileSync(this.logPath, "utf8");
    } catch {
      return "";
    }
  }

  async kill() {
    if (this.exit === undefined) {
      try {
        this.child.kill("SIGCONT");
        this.child.kill("SIGKILL");
      } catch {}
      await this.exited;
    }
    this.log.end();
  }
}

/** The JSON event lines a worker process prints on stdout. */
export class Events {
  constructor(proc) {
    this.lines = [];
    let rest = "";
    proc.child.stdout.setEncoding("utf8");
    proc.child.stdout.on("data", (chunk) => {
      proc.log.write(chunk);
      rest += chunk;
      const parts = rest.split("\n");
      rest = parts.pop();
      for (const line of parts) {
        try {
          this.lines.push(JSON.parse(line));
        } catch {}
      }
    });
  }

  find(want) {
    return this.lines.filter((e) => Object.entries(want).every(([k, v]) => e[k] === v));
  }

  wait(what, want, timeoutSeconds = 20) {
    return waitUntil(what, timeoutSeconds, () => {
      const found = this.find(want);
      return found.length ? found : undefined;
    });
  }
}

/** Starts processes for one test (`procs.sidecar(...)`, `procs.start(...)`), killed after it. */
export function procsFor(t) {
  const started = [];
  t.after(async () => {
    for (const p of started.reverse()) await p.kill();
  });
  return {
    async sidecar(queue, identity, extra = []) {
      const port = await freePort();
      const p = new Proc(`${identity}-sidecar`, process.env.LEASEHOLD_BIN, [
        "sidecar",
        "--namespace", NAMESPACE,
        "--queue", queue,
        "--identity", identity,
        "--listen", `127.0.0.1:${port}`,
        "--metrics-addr", "127.0.0.1:0",
        ...extra,
      ], { env: { RUST_LOG: "info" } });
      started.push(p);
      p.base = `http://127.0.0.1:${port}`;
      await waitUntil(`sidecar ${identity} ready`, 30, async () => {
        if (p.exit !== undefined) throw new Error(`sidecar exited:\n${p.logText()}`);
        try {
          const r = await fetch(`${p.base}/readyz`, { signal: AbortSignal.timeout(2000) });
          return r.status === 200;
        } catch {
          return false;
        }
      });
      return p;
    },
    start(name, command, args, options) {
      const p = new Proc(name, command, args, options);
      started.push(p);
      return p;
    },
  };
}

/** Collects a client's events (`new Client({onEvent: recorder.record})`). */
export class Recorder {
  constructor() {
    this.events = [];
    this.record = (event) => this.events.push(event);
  }

  kinds(name, attempt) {
    return this.events
      .filter((e) => (name === undefined || e.name === name) && (attempt === undefined || e.attempt === attempt))
      .map((e) => [e.kind, e.status ?? null]);
  }
}
