/**
 * The worker loop: claims jobs, runs a handler on each (up to `concurrency` at once), ends each
 * attempt exactly once, and stops gracefully on SIGTERM.
 *
 * @module
 */

import { type ClaimAnswer, Client, type Event, MAX_CLAIM_WAIT } from "./client.js";
import { ApiError, Cancelled, ConnectionFailed, Fail, JobLost, ShutdownRequested, ShuttingDown } from "./errors.js";
import { Job, describeError, isAbortError } from "./job.js";
import { typeName, whyNotJson } from "./json.js";
import { type Logger, stderrLogger } from "./log.js";
import { startJobSpan } from "./tracing.js";

/** A handler: gets the job, returns (or resolves to) its result. */
export type Handler = (job: Job) => unknown;

/** What a running job does when the worker is asked to stop. */
export type ShutdownPolicy = "release" | "finish";

/** Options of {@link Worker} and {@link run}. */
export interface WorkerOptions {
  /** The sidecar's client; default `new Client({baseUrl: sidecar, onEvent})`. */
  client?: Client;
  /** The sidecar's base URL, when no `client` is given; default `$LEASEHOLD_SIDECAR`. */
  sidecar?: string;
  /** The client's event listener, when no `client` is given. */
  onEvent?: (event: Event) => void;
  /** Seconds each claim long-polls, 0..300; default 20. */
  wait?: number;
  /** How many jobs run at once, each with its own heartbeats, through one sidecar; default 1. */
  concurrency?: number;
  /**
   * On the first SIGTERM or SIGINT (or {@link Worker.stop}): `"release"` (the default) aborts
   * each running job's `signal` with {@link ShutdownRequested}, and the job is handed back with
   * its latest checkpoint when its handler throws; `"finish"` lets the handlers run to the end
   * (check `job.stopping` to cut them short).
   */
  onShutdown?: ShutdownPolicy;
  /** Claim no more after this many jobs (then finish them and resolve); 0 for no limit. */
  maxJobs?: number;
  /** Claim no more once a claim finds nothing (204). */
  exitWhenIdle?: boolean;
  /** Seconds between heartbeats; default leaseDurationSeconds / 3 (see {@link JobOptions}). */
  heartbeatInterval?: number;
  /** Handle SIGTERM and SIGINT while {@link Worker.run} runs; default true. */
  handleSignals?: boolean;
  /** Where to log; default {@link stderrLogger} (lines on stderr). */
  logger?: Logger;
}

const SIGNAL_NUMBERS: Record<string, number> = { SIGINT: 2, SIGTERM: 15 };

/**
 * Runs `handler(job)` on each job claimed from the sidecar, up to `concurrency` at once.
 *
 * The handler gets a {@link Job} whose heartbeats run in the background. What it does decides
 * how the attempt ends:
 *
 * - returns a value (or resolves to one): the job is completed with it as the result
 *   (`undefined` is `null`), unless the handler ended the job itself or the job was lost (then
 *   nothing is sent); a value that is not JSON (a `Map`, a class instance, a bigint, `NaN`...)
 *   fails the attempt as not retryable, reason `ResultNotJSON`, naming its type: another
 *   attempt would return the same;
 * - throws {@link Fail}: the attempt fails with its reason, message, retryable and
 *   retryAfterSeconds;
 * - throws a {@link JobLost} (e.g. from `job.check()`), or an abort error of `job.signal` after
 *   a loss: nothing is sent;
 * - throws {@link ShutdownRequested} (or an abort error of `job.signal` during a shutdown): the
 *   job is released with its latest checkpoint;
 * - throws anything else: the attempt fails (reason `WorkerError`, retryable), the error is
 *   logged, and the worker goes on.
 *
 * Tracing: with `@opentelemetry/api` installed (an optional peer dependency), each handler runs
 * inside a span `leasehold.job <queue>` whose parent is the producer's span (the claim's
 * `traceparent`); see tracing.ts. Without it, nothing of it is imported.
 *
 * When the sidecar answers a claim with `shutting_down` (it is draining: its pod is stopping),
 * the worker claims nothing more, lets the running jobs finish, and resolves, logging one line.
 *
 * Stopping: the first SIGTERM or SIGINT stops claiming (a claim waiting in its long poll is
 * aborted; the sidecar gives back a job it claimed meanwhile) and, with `onShutdown:
 * "release"`, aborts the running jobs' signals so that they are handed back at once. A second
 * signal exits the process at once (status 128 + the signal's number), saying which jobs it
 * abandons (their leases then expire).
 */
export class Worker {
  /** The sidecar's client. */
  readonly client: Client;
  /** Whether the worker was asked to stop (first signal, or {@link stop}). */
  stopping = false;
  private readonly handler: Handler;
  private readonly wait: number;
  private readonly concurrency: number;
  private readonly onShutdown: ShutdownPolicy;
  private readonly maxJobs: number;
  private readonly exitWhenIdle: boolean;
  private readonly heartbeatInterval: number | undefined;
  private readonly handleSignals: boolean;
  private readonly log: Logger;
  private readonly claimAbort = new AbortController();
  private readonly shutdown = new AbortController();
  private readonly runningJobs = new Map<Job, Promise<void>>();
  private wakeLoop: (() => void) | undefined = undefined;

  /**
   * @param handler - `async (job) => result`.
   * @param options - see {@link WorkerOptions}.
   * @throws TypeError for a handler that is not a function (or is a generator function), and
   * RangeError for an option out of range.
   */
  constructor(handler: Handler, options: WorkerOptions = {}) {
    if (typeof handler !== "function") {
      throw new TypeError(
        `handler must be a function (or an async function) taking a leasehold Job, not ${typeName(handler)} ${JSON.stringify(handler) ?? typeof handler}`,
      );
    }
    const kind = (handler as { constructor?: { name?: string } }).constructor?.name;
    if (kind === "GeneratorFunction" || kind === "AsyncGeneratorFunction") {
      throw new TypeError(
        `handler ${handler.name || "(anonymous)"} is a generator function: it must return the result (or a promise of it)`,
      );
    }
    const wait = options.wait ?? 20;
    if (typeof wait !== "number" || !(wait >= 0 && wait <= MAX_CLAIM_WAIT)) {
      throw new RangeError(`wait must be 0..${MAX_CLAIM_WAIT} seconds, not ${String(wait)}`);
    }
    const concurrency = options.concurrency ?? 1;
    if (!Number.isInteger(concurrency) || concurrency < 1) {
      throw new RangeError(`concurrency must be a whole number from 1, not ${String(concurrency)}`);
    }
    const onShutdown = options.onShutdown ?? "release";
    if (onShutdown !== "release" && onShutdown !== "finish") {
      throw new RangeError(`onShutdown must be "release" or "finish", not ${JSON.stringify(onShutdown)}`);
    }
    const maxJobs = options.maxJobs ?? 0;
    if (!Number.isInteger(maxJobs) || maxJobs < 0) {
      throw new RangeError(`maxJobs must be a whole number from 0 (no limit), not ${String(maxJobs)}`);
    }
    this.handler = handler;
    this.client =
      options.client ??
      new Client({
        ...(options.sidecar !== undefined ? { baseUrl: options.sidecar } : {}),
        ...(options.onEvent !== undefined ? { onEvent: options.onEvent } : {}),
      });
    this.wait = Math.floor(wait);
    this.concurrency = concurrency;
    this.onShutdown = onShutdown;
    this.maxJobs = maxJobs;
    this.exitWhenIdle = options.exitWhenIdle ?? false;
    this.heartbeatInterval = options.heartbeatInterval;
    this.handleSignals = options.handleSignals ?? true;
    this.log = options.logger ?? stderrLogger;
  }

  /** The jobs running now. */
  get running(): ReadonlySet<Job> {
    return new Set(this.runningJobs.keys());
  }

  /** Asks the worker to stop, as the first SIGTERM does. */
  stop(): void {
    if (this.stopping) return;
    this.stopping = true;
    this.claimAbort.abort(new ShutdownRequested("the worker is stopping"));
    if (this.onShutdown === "release") this.shutdown.abort(new ShutdownRequested("the worker is stopping"));
    this.wakeLoop?.();
  }

  /**
   * Claims and handles jobs until stopped (a signal, {@link stop}, `maxJobs`, `exitWhenIdle`,
   * or a draining sidecar), then waits for the running jobs to end.
   *
   * @returns how many jobs were handled.
   */
  async run(): Promise<number> {
    const installed: [string, (signal: NodeJS.Signals) => void][] = [];
    if (this.handleSignals) {
      for (const name of ["SIGTERM", "SIGINT"] as const) {
        const listener = (signal: NodeJS.Signals) => this.onSignal(signal);
        process.on(name, listener);
        installed.push([name, listener]);
      }
    }
    try {
      return await this.loop();
    } finally {
      for (const [name, listener] of installed) process.off(name, listener);
    }
  }

  private onSignal(signal: NodeJS.Signals): void {
    if (!this.stopping) {
      this.log.info(
        `${signal}: claiming nothing more; ` +
          (this.onShutdown === "release"
            ? `handing back ${this.runningJobs.size} running job(s)`
            : `letting ${this.runningJobs.size} running job(s) finish`),
      );
      this.stop();
      return;
    }
    const held = [...this.runningJobs.keys()].filter((job) => job.ended === undefined);
    const abandoned = held.length
      ? `; abandoning ${held.map((job) => `${job.label} attempt ${job.attempt}`).join(", ")}, whose lease expires`
      : "";
    process.stderr.write(`leasehold: second signal ${signal}: exiting now${abandoned}\n`);
    process.exit(128 + (SIGNAL_NUMBERS[signal] ?? 0));
  }

  private async loop(): Promise<number> {
    this.log.info(
      `Worker started for ${this.client.baseUrl}, long-polling ${this.wait} s per claim, ` +
        `up to ${this.concurrency} job(s) at once`,
    );
    let claimed = 0;
    let backoff = 0.5;
    let drained = false;
    while (!this.stopping) {
      if (this.maxJobs && claimed >= this.maxJobs) {
        this.log.info(`Claimed ${claimed} job(s): claiming nothing more`);
        break;
      }
      if (this.runningJobs.size >= this.concurrency) {
        await this.nap(undefined);
        continue;
      }
      let answer: ClaimAnswer | null;
      try {
        answer = await this.client.claim(this.wait, { signal: this.claimAbort.signal });
      } catch (err) {
        if (this.stopping) break;
        if (err instanceof ShuttingDown) {
          drained = true;
          break;
        }
        if (!(err instanceof ConnectionFailed || err instanceof ApiError)) throw err;
        if (err instanceof ConnectionFailed) this.client.emit({ kind: "error", message: `claim: ${err.message}` });
        this.log.warn(`Claim failed: ${err.message}; retrying in ${backoff.toFixed(1)} s`);
        await this.pause(backoff);
        backoff = Math.min(backoff * 2, 5);
        continue;
      }
      backoff = 0.5;
      if (answer === null) {
        if (this.exitWhenIdle) {
          this.log.info("Nothing to claim: claiming nothing more (exitWhenIdle)");
          break;
        }
        if (this.wait === 0) await this.pause(1);
        continue;
      }
      claimed += 1;
      const job = new Job(this.client, answer, {
        ...(this.heartbeatInterval !== undefined ? { heartbeatInterval: this.heartbeatInterval } : {}),
        shutdown: this.shutdown.signal,
        stopping: () => this.stopping,
        logger: this.log,
      });
      const done = this.handle(job).finally(() => {
        this.runningJobs.delete(job);
        this.wakeLoop?.();
      });
      this.runningJobs.set(job, done);
    }
    await Promise.all(this.runningJobs.values());
    if (drained) {
      this.log.info(`The sidecar is shutting down: claiming nothing more; handled ${claimed} job(s)`);
    } else if (this.stopping) {
      this.log.info(`Stopped on request; handled ${claimed} job(s)`);
    }
    return claimed;
  }

  /** Runs the handler on one job and ends its attempt (see the class). Never throws. */
  private async handle(job: Job): Promise<void> {
    this.log.info(`Claimed LeasedJob ${job.label} (attempt ${job.attempt})`);
    if (this.stopping && this.onShutdown === "release") {
      // Claimed just as the worker was asked to stop: hand it back untouched.
      await job.finish({ error: new ShutdownRequested("the worker is stopping") });
      return;
    }
    // The attempt's span (with OpenTelemetry only): current while the handler runs, ended
    // once the attempt has, saying how.
    const traced = await startJobSpan(job);
    job.start();
    let outcome: { error: unknown } | undefined;
    try {
      const result = await (traced ? traced.run(() => this.handler(job)) : this.handler(job));
      if (job.ended === undefined && job.lost === undefined) {
        const value = result === undefined ? null : result;
        const why = whyNotJson(value);
        if (why !== undefined) {
          const message = `the handler's result of type ${typeName(value)} is not JSON: ${why}`;
          this.log.error(`${job.label}: ${message}`);
          await job.fail("ResultNotJSON", message, { retryable: false });
        } else {
          await job.complete(value);
        }
      }
    } catch (err) {
      outcome = { error: err };
      const expected =
        err instanceof Fail ||
        err instanceof JobLost ||
        err instanceof ShutdownRequested ||
        (job.signal.aborted && isAbortError(err));
      const handedBack =
        err instanceof ShutdownRequested ||
        err instanceof Cancelled ||
        (job.signal.aborted && isAbortError(err) && (job.lost === undefined || job.lost instanceof Cancelled));
      if (!handedBack) traced?.error(err);
      if (!expected) {
        this.client.emit({ kind: "error", name: job.name, attempt: job.attempt, message: `handler failed: ${describeError(err)}` });
        this.log.error(`Handler failed on ${job.label}: ${err instanceof Error ? (err.stack ?? err.message) : describeError(err)}`);
      }
    }
    try {
      await job.finish(outcome);
    } catch (err) {
      this.log.error(`Ending ${job.label} failed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
    } finally {
      traced?.end();
    }
    if (job.ended !== undefined) {
      this.log.info(`Ended LeasedJob ${job.label} (attempt ${job.attempt}): ${job.ended}`);
    }
  }

  /** Sleeps `seconds`, or less when the worker is asked to stop. */
  private async pause(seconds: number): Promise<void> {
    if (!this.stopping) await this.nap(seconds);
  }

  /**
   * Waits until a job ends, the worker is asked to stop, or `seconds` pass (when given): the
   * loop's one place to wait.
   */
  private async nap(seconds: number | undefined): Promise<void> {
    let timer: NodeJS.Timeout | undefined;
    await new Promise<void>((resolve) => {
      this.wakeLoop = resolve;
      if (seconds !== undefined) timer = setTimeout(resolve, seconds * 1000);
    });
    this.wakeLoop = undefined;
    clearTimeout(timer);
  }
}

/**
 * `new Worker(handler, options).run()`: claims and handles jobs until SIGTERM/SIGINT (or
 * `maxJobs`, `exitWhenIdle`, a draining sidecar). Resolves with how many jobs were handled.
 */
export function run(handler: Handler, options: WorkerOptions = {}): Promise<number> {
  return new Worker(handler, options).run();
}
