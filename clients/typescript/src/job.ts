/**
 * A claimed job: its claim, background heartbeats, and the calls that end its attempt.
 *
 * @module
 */

import {
  CALL_TIMEOUT,
  type ClaimAnswer,
  type Client,
  type EndAnswer,
  type Failure,
  type HeartbeatAnswer,
  checkFailure,
  retrying,
} from "./client.js";
import {
  ApiError,
  ConnectionFailed,
  Fail,
  type FailOptions,
  InvalidRequest,
  JobEnded,
  JobLost,
  LeaseUnconfirmed,
  LeaseholdError,
  RequestRejected,
  ShutdownRequested,
  TooLarge,
  Unavailable,
} from "./errors.js";
import { typeName, whyNotJson } from "./json.js";
import { type Logger, stderrLogger } from "./log.js";

/** The sidecar refuses a checkpoint over this many bytes of JSON (docs/protocol.md). */
export const MAX_CHECKPOINT_BYTES = 64 * 1024;
/** The sidecar refuses a progress message over this many bytes of UTF-8 (docs/protocol.md). */
export const MAX_PROGRESS_MESSAGE_BYTES = 256;
/**
 * Heartbeats are sent every leaseDurationSeconds / HEARTBEAT_FRACTION: two more chances
 * before the lease runs out when one is lost (the sidecar renews at the same rate).
 */
export const HEARTBEAT_FRACTION = 3;
/** Seconds between tries of a heartbeat that got no confirmation (at most the interval). */
export const RETRY_PAUSE = 1;

/** How a job's attempt ended, once the sidecar accepted it. */
export type Ending = "complete" | "fail" | "release";

/** Options of {@link Job}. */
export interface JobOptions {
  /**
   * Seconds between background heartbeats; default leaseDurationSeconds / 3. Values above
   * leaseDurationSeconds / 2 are capped there: one lost heartbeat must not cost the lease.
   */
  heartbeatInterval?: number;
  /**
   * Aborts when the worker asks running jobs to be handed back (SIGTERM with the `"release"`
   * policy): then `job.signal` aborts with {@link ShutdownRequested} and {@link Job.check}
   * throws it.
   */
  shutdown?: AbortSignal;
  /** Whether the worker was asked to stop, whatever its policy (see {@link Job.stopping}). */
  stopping?: () => boolean;
  /** Where to log; default {@link stderrLogger}. */
  logger?: Logger;
}

/**
 * One claimed attempt of a LeasedJob.
 *
 * {@link Worker} hands one to your handler, with heartbeats running. Used on its own:
 *
 * ```ts
 * const job = await Job.claim(client, 30);
 * if (job) {
 *   job.start(); // background heartbeats
 *   try {
 *     for (let step = (job.checkpoint as number) ?? 0; step < 100; step++) {
 *       await work(step, job.signal);
 *       job.save(step + 1); // sent with the next heartbeat
 *       job.progress((step + 1) / 100, `step ${step + 1}`);
 *       job.check(); // throws once the job is lost or cancelled
 *     }
 *     await job.complete({ steps: 100 });
 *     await job.finish();
 *   } catch (err) {
 *     await job.finish({ error: err }); // fails, releases, or sends nothing, as fits
 *   }
 * }
 * ```
 *
 * Sends are serialised: checkpoints reach the sidecar in the order they were saved, and an
 * ending waits for a heartbeat in flight.
 */
export class Job {
  /** The sidecar's client. */
  readonly client: Client;
  /** The sidecar's whole claim answer. */
  readonly claimAnswer: ClaimAnswer;
  /** The LeasedJob's name. */
  readonly name: string;
  /** The LeasedJob's namespace. */
  readonly namespace: string;
  /** The attempt number, from 1. */
  readonly attempt: number;
  /** The fencing token of this attempt (`<attempt>.<32 hex>`). */
  readonly token: string;
  /** `spec.payload`, any JSON. */
  readonly payload: unknown;
  /**
   * The checkpoint to resume from: the last one a previous attempt saved, or `null` for a
   * fresh start. It does not change while the job runs; the one saved last is {@link saved}.
   */
  readonly checkpoint: unknown;
  /** How many failed attempts end the job; `undefined` from sidecars that do not say. */
  readonly maxAttempts: number | undefined;
  /** Earlier failed attempts, oldest first; `undefined` from sidecars that do not say. */
  readonly failures: readonly Failure[] | undefined;
  /** Whether a failure of this attempt ends the job; `undefined` from sidecars that do not say. */
  readonly lastAttempt: boolean | undefined;
  /** The job's queue; `undefined` from sidecars that do not say. */
  readonly queue: string | undefined;
  /**
   * The producer's W3C traceparent (the job's annotation `leasehold.dev/traceparent`), when it
   * set a valid one: the parent of the handler's span (tracing.ts).
   */
  readonly traceparent: string | undefined;
  /** The producer's W3C tracestate, only beside a traceparent. */
  readonly tracestate: string | undefined;
  /** leaseDurationSeconds (updated by heartbeat answers). */
  leaseDurationSeconds: number;
  /** Why the job is no longer this worker's, once it is not. */
  lost: JobLost | undefined = undefined;
  /** How the attempt ended, once the sidecar accepted an ending. */
  ended: Ending | undefined = undefined;

  private readonly controller = new AbortController();
  private readonly intervalWanted: number | undefined;
  private readonly shutdownSignal: AbortSignal | undefined;
  private readonly isStopping: () => boolean;
  private readonly log: Logger;
  private chain: Promise<unknown> = Promise.resolve();
  private pending: { value: unknown } | undefined = undefined;
  private savedValue: unknown;
  private progressValue: number | undefined = undefined;
  private messageValue: string | undefined = undefined;
  private confirmedAt = performance.now(); // the claim renewed the lease
  private gaveUp = false;
  private running = false;
  private timer: NodeJS.Timeout | undefined = undefined;
  private inFlight: Promise<void> | undefined = undefined;
  private detach: (() => void) | undefined = undefined;

  /**
   * Wraps a claim answer ({@link Client.claim}).
   *
   * @param client - the sidecar's client.
   * @param claim - the claim answer.
   * @param options - heartbeat interval, shutdown signal, logger.
   */
  constructor(client: Client, claim: ClaimAnswer, options: JobOptions = {}) {
    this.client = client;
    this.claimAnswer = claim;
    this.name = claim.name;
    this.namespace = typeof claim.namespace === "string" ? claim.namespace : "";
    this.attempt = typeof claim.attempt === "number" ? claim.attempt : 0;
    this.token = claim.token;
    this.payload = claim.payload ?? null;
    this.checkpoint = claim.checkpoint ?? null;
    this.savedValue = this.checkpoint;
    const duration = claim.leaseDurationSeconds;
    this.leaseDurationSeconds = typeof duration === "number" && duration > 0 ? duration : 60;
    this.maxAttempts = typeof claim.maxAttempts === "number" ? claim.maxAttempts : undefined;
    this.failures = Array.isArray(claim.failures) ? claim.failures : undefined;
    this.lastAttempt = typeof claim.lastAttempt === "boolean" ? claim.lastAttempt : undefined;
    this.queue = typeof claim.queue === "string" && claim.queue ? claim.queue : undefined;
    this.traceparent = typeof claim.traceparent === "string" && claim.traceparent ? claim.traceparent : undefined;
    this.tracestate =
      this.traceparent !== undefined && typeof claim.tracestate === "string" && claim.tracestate
        ? claim.tracestate
        : undefined;
    this.intervalWanted = options.heartbeatInterval;
    this.shutdownSignal = options.shutdown;
    this.isStopping = options.stopping ?? (() => this.shutdownSignal?.aborted ?? false);
    this.log = options.logger ?? stderrLogger;
    const shutdown = this.shutdownSignal;
    if (shutdown !== undefined) {
      const onShutdown = () => this.abort(new ShutdownRequested(`the worker is stopping: ${this.label} is handed back`));
      if (shutdown.aborted) onShutdown();
      else {
        shutdown.addEventListener("abort", onShutdown, { once: true });
        // The worker's signal outlives its jobs: each job takes its listener away when done.
        this.detach = () => shutdown.removeEventListener("abort", onShutdown);
      }
    }
  }

  /**
   * Claims a job (long poll of `wait` seconds, 0..300); `null` when nothing was claimable in
   * time. Throws as {@link Client.claim}.
   */
  static async claim(client: Client, wait: number = 20, options: JobOptions = {}): Promise<Job | null> {
    const answer = await client.claim(wait);
    return answer === null ? null : new Job(client, answer, options);
  }

  /** `namespace/name`, as logs and messages name the job. */
  get label(): string {
    return this.namespace ? `${this.namespace}/${this.name}` : this.name;
  }

  /**
   * Aborts once the job is no longer worth working on, with the reason: the {@link JobLost}
   * error (lease lost, cancelled, finished, deleted, unconfirmed), {@link ShutdownRequested}
   * (the worker is stopping and hands the job back), or {@link JobEnded} once this worker ended
   * the attempt. Pass it to `fetch`, `setTimeout` of `node:timers/promises`, child processes.
   */
  get signal(): AbortSignal {
    return this.controller.signal;
  }

  /** The checkpoint saved last (by {@link save}), else the one resumed from. */
  get saved(): unknown {
    return this.savedValue;
  }

  /** Whether the worker was asked to stop (SIGTERM or SIGINT), whatever its policy. */
  get stopping(): boolean {
    return this.isStopping();
  }

  /** Seconds between background heartbeats. */
  get heartbeatInterval(): number {
    const wanted = this.intervalWanted ?? this.leaseDurationSeconds / HEARTBEAT_FRACTION;
    return Math.max(0.1, Math.min(wanted, this.leaseDurationSeconds / 2));
  }

  // ---- while working

  /**
   * Saves `checkpoint` (any JSON value but `null`/`undefined`, at most 64 KiB encoded) for the
   * next attempt to resume from, should this one not finish. It is sent with the next
   * heartbeat (within {@link heartbeatInterval} seconds, and before a release); only the latest
   * is sent. Does not block.
   *
   * @throws {@link TooLarge} over 64 KiB as JSON. {@link InvalidRequest}: `null`, `undefined`
   * or not JSON.
   */
  save(checkpoint: unknown): void {
    if (checkpoint === null || checkpoint === undefined) {
      throw new InvalidRequest(
        400,
        "invalid_request",
        `a checkpoint cannot be ${String(checkpoint)} (no checkpoint means "keep the last one")`,
      );
    }
    const why = whyNotJson(checkpoint);
    if (why !== undefined) throw new InvalidRequest(400, "invalid_request", `checkpoint of ${this.label} is not JSON: ${why}`);
    const size = Buffer.byteLength(JSON.stringify(checkpoint), "utf8");
    if (size > MAX_CHECKPOINT_BYTES) {
      throw new TooLarge(
        413,
        "too_large",
        `checkpoint of ${this.label} is ${size} bytes as JSON, over the sidecar's limit of ${MAX_CHECKPOINT_BYTES}; ` +
          "keep large state elsewhere and checkpoint a reference to it",
      );
    }
    this.pending = { value: checkpoint };
    this.savedValue = checkpoint;
  }

  /**
   * Reports how far the attempt is, for people watching (`kubectl leasehold get` draws a bar
   * and shows the message): `fraction` done from 0 to 1, and a short `message` (at most 256
   * bytes of UTF-8, one line). `undefined` leaves that part as last reported. Every heartbeat
   * from now on carries the latest values; they cost no extra request. Does not block.
   *
   * @throws {@link InvalidRequest} `fraction` is not a number from 0 to 1, or `message` is not
   * a string of at most 256 bytes without control characters (the sidecar's rules, checked here
   * so that a heartbeat is never refused for them).
   */
  progress(fraction?: number, message?: string): void {
    if (fraction !== undefined) {
      if (typeof fraction !== "number" || !Number.isFinite(fraction) || fraction < 0 || fraction > 1) {
        throw new InvalidRequest(
          400,
          "invalid_request",
          `progress ${JSON.stringify(fraction) ?? String(fraction)} is out of range: expected a number from 0 to 1 (the fraction done)`,
        );
      }
    }
    if (message !== undefined) {
      if (typeof message !== "string") {
        throw new InvalidRequest(400, "invalid_request", `message ${String(message)} is not a string`);
      }
      const size = Buffer.byteLength(message, "utf8");
      if (size > MAX_PROGRESS_MESSAGE_BYTES) {
        throw new InvalidRequest(
          400,
          "invalid_request",
          `message is ${size} bytes: at most ${MAX_PROGRESS_MESSAGE_BYTES} bytes of UTF-8 are accepted`,
        );
      }
      if (/[\u0000-\u001f\u007f-\u009f]/.test(message)) {
        throw new InvalidRequest(
          400,
          "invalid_request",
          `message ${JSON.stringify(message)} contains a control character (a line break, a tab, ...): it is shown on one line`,
        );
      }
    }
    if (fraction !== undefined) this.progressValue = fraction;
    if (message !== undefined) this.messageValue = message;
  }

  /**
   * Returns while the job is still this worker's; call it often (between chunks).
   *
   * @throws {@link JobLost} the lease was lost, the job cancelled, finished or deleted, or no
   * heartbeat was confirmed for a whole lease ({@link LeaseUnconfirmed}).
   * {@link ShutdownRequested}: the worker was asked to stop and releases jobs on stop.
   * {@link JobEnded}: this worker already ended the attempt.
   */
  check(): void {
    this.checkOwned();
    if (this.shutdownSignal?.aborted) {
      throw new ShutdownRequested(`the worker is stopping: ${this.label} is handed back`);
    }
  }

  /**
   * As {@link check}, but ignoring a stop request: throws when the job can no longer be ended
   * by this worker.
   */
  checkOwned(): void {
    if (this.lost !== undefined) throw this.lost;
    if (this.ended !== undefined) {
      throw new JobEnded(`${this.label} attempt ${this.attempt} was already ended (${this.ended})`);
    }
  }

  /**
   * Sleeps `seconds`, waking at once when {@link signal} aborts; then throws as {@link check}.
   */
  async sleep(seconds: number): Promise<void> {
    this.check();
    await new Promise<void>((resolve) => {
      const signal = this.signal;
      const done = () => {
        clearTimeout(timer);
        signal.removeEventListener("abort", done);
        resolve();
      };
      const timer = setTimeout(done, Math.max(0, seconds * 1000));
      signal.addEventListener("abort", done, { once: true });
    });
    this.check();
  }

  /**
   * Sends a heartbeat now, with the checkpoint saved since the last one (if any) and the latest
   * progress, instead of waiting for the background one.
   *
   * @returns the answer `{renewTime, expiresAt, leaseDurationSeconds}`.
   * @throws {@link JobLost} as {@link check}. {@link Unavailable}, {@link ConnectionFailed}:
   * not confirmed this time (the background heartbeats go on). {@link TooLarge}: the
   * checkpoint was refused.
   */
  async heartbeat(): Promise<HeartbeatAnswer> {
    this.check();
    return this.locked(() => this.beat());
  }

  // ---- ending the attempt

  /**
   * Ends the attempt as Succeeded with `result` (any JSON; the whole job stays under 1 MiB as
   * JSON). Repeats the call while the sidecar answers `unavailable` or cannot be reached, for up
   * to max(30 s, leaseDurationSeconds).
   *
   * Never sends anything once the job is known to be lost: the late result of a worker that
   * lost its lease is not offered as if it still held the job.
   *
   * @returns `{namespace, name, attempt, phase: "Succeeded"}`.
   * @throws {@link JobLost}: the job was or is now lost; nothing was accepted.
   * {@link JobEnded}: already ended. {@link TooLarge}: the result is too large (the job is still
   * held). {@link InvalidRequest}: the result is not JSON (nothing sent).
   * {@link Unavailable}, {@link ConnectionFailed}: no answer in time.
   */
  async complete(result: unknown = null): Promise<EndAnswer> {
    const value = result === undefined ? null : result;
    const why = whyNotJson(value);
    if (why !== undefined) {
      throw new InvalidRequest(400, "invalid_request", `the result of ${this.label} is not JSON: ${why}`);
    }
    return this.locked(() =>
      this.end("complete", () => this.client.complete(this.name, this.token, value, this.callOptions())),
    );
  }

  /**
   * Ends the attempt as failed.
   *
   * @param reason - CamelCase word, `^[A-Za-z][A-Za-z0-9]*$`, at most 64 characters.
   * @param message - what happened (at most 4096 bytes of UTF-8; longer is cut).
   * @param options - `retryable` (default false): whether another attempt could succeed;
   * `retryAfterSeconds` (0..86400, with `retryable` only): delay before the next attempt.
   * @returns `{..., phase}` with phase `"Queued"` or `"Failed"`.
   * @throws as {@link complete}, and {@link InvalidRequest} for a bad reason or
   * retryAfterSeconds (nothing sent).
   */
  async fail(reason: string, message: string = "", options: FailOptions = {}): Promise<EndAnswer> {
    checkFailure(reason, options.retryable ?? false, options.retryAfterSeconds);
    return this.locked(() =>
      this.end("fail", () =>
        this.client.fail(this.name, this.token, reason, message, { ...this.callOptions(), ...options }),
      ),
    );
  }

  /**
   * Hands the job back: it is requeued at once (not a failed attempt) and the next attempt
   * resumes from the latest checkpoint, which is sent first if it has not been.
   *
   * @returns `{..., phase: "Queued"}`.
   * @throws as {@link complete}.
   */
  async release(): Promise<EndAnswer> {
    return this.locked(async () => {
      if (this.lost === undefined && this.ended === undefined && this.pending !== undefined) {
        try {
          await this.beat();
        } catch (err) {
          if (err instanceof JobLost) throw err;
          if (!(err instanceof LeaseholdError)) throw err;
          // The release still hands the job back.
          this.log.warn(`Could not send the last checkpoint of ${this.label} before releasing it: ${err.message}`);
        }
      }
      return this.end("release", () => this.client.release(this.name, this.token, this.callOptions()));
    });
  }

  // ---- heartbeats and the end of the attempt

  /** Starts the background heartbeats (the worker does it before calling the handler). */
  start(): void {
    if (this.running || this.ended !== undefined || this.lost !== undefined) return;
    this.running = true;
    this.schedule(this.heartbeatInterval);
  }

  /** Stops the background heartbeats, waiting for one in flight to finish. */
  async stop(): Promise<void> {
    this.running = false;
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    if (this.inFlight !== undefined) await this.inFlight;
  }

  /**
   * Stops the heartbeats and makes sure the attempt ends once, as a handler's outcome says:
   *
   * - the attempt was already ended (complete, fail, release): nothing more;
   * - `error` is a {@link Fail}: the attempt is failed with its reason, message, retryable and
   *   retryAfterSeconds;
   * - no error, or {@link ShutdownRequested}: the job is released (with its latest checkpoint);
   * - a {@link JobLost}, or the job is lost: nothing is sent (but a release, when the loss was
   *   only presumed: {@link LeaseUnconfirmed});
   * - any other error: the attempt is failed (reason `WorkerError`, retryable).
   *
   * An error thrown because {@link signal} aborted (an `AbortError`) counts as the signal's
   * reason. An attempt that ended without an accepted ending is reported as a `lost` event.
   * Never throws: failures to send are logged.
   *
   * @param outcome - `{error}` when the work threw; omitted when it returned.
   */
  async finish(outcome?: { error: unknown }): Promise<void> {
    await this.stop();
    let error = outcome?.error;
    const threw = outcome !== undefined;
    if (threw && this.signal.aborted && isAbortError(error)) error = this.signal.reason;
    if (error instanceof JobLost && this.lost === undefined) this.setLost(error);
    if (this.ended === undefined && this.lost === undefined && !this.gaveUp) {
      if (error instanceof Fail) {
        try {
          await this.fail(error.reason, error.message, {
            retryable: error.retryable,
            ...(error.retryAfterSeconds !== undefined ? { retryAfterSeconds: error.retryAfterSeconds } : {}),
          });
        } catch (err) {
          if (err instanceof RequestRejected) {
            // A Fail the sidecar cannot take (a bad reason): still end the attempt, saying why.
            this.log.error(`${this.label}: ${err.message}`);
            await this.quietly(() => this.fail("WorkerError", `the handler threw an invalid Fail: ${err.serverMessage}`, { retryable: true }));
          } else {
            this.logFailure(err);
          }
        }
      } else if (!threw || error instanceof ShutdownRequested) {
        if (!threw) this.log.warn(`${this.label} was neither completed nor failed: releasing it`);
        await this.quietly(() => this.release());
      } else if (!(error instanceof JobEnded) && !(error instanceof JobLost)) {
        await this.quietly(() => this.fail("WorkerError", describeError(error), { retryable: true }));
      }
    }
    if (this.lost instanceof LeaseUnconfirmed && this.ended === undefined) await this.releaseUnconfirmed();
    this.detach?.();
    if (this.ended === undefined) {
      const why = this.lost !== undefined ? this.lost.message : "no ending was accepted";
      this.client.emit({ kind: "lost", name: this.name, attempt: this.attempt, message: why });
      this.log.warn(`Gave up ${this.label} (attempt ${this.attempt}): ${why}`);
    }
  }

  // ---- internals

  private callOptions(): { attempt: number } {
    return { attempt: this.attempt };
  }

  private abort(reason: LeaseholdError): void {
    if (!this.controller.signal.aborted) this.controller.abort(reason);
  }

  private setLost(err: JobLost): void {
    if (this.lost === undefined) {
      this.lost = err;
      this.log.warn(`Lost LeasedJob ${this.label} (attempt ${this.attempt}): ${err.message}`);
    }
    this.abort(err);
  }

  /** Runs `call` after every send queued before it: one send at a time, in order. */
  private locked<T>(call: () => Promise<T>): Promise<T> {
    const result = this.chain.then(call, call);
    this.chain = result.catch(() => undefined);
    return result;
  }

  private async quietly(call: () => Promise<unknown>): Promise<void> {
    try {
      await call();
    } catch (err) {
      this.logFailure(err);
    }
  }

  private logFailure(err: unknown): void {
    if (err instanceof JobLost) return; // logged when it was set
    this.log.warn(`${this.label}: ${err instanceof Error ? err.message : String(err)}`);
  }

  /**
   * After {@link LeaseUnconfirmed}, the sidecar may still hold the job, and renews it while it
   * hears from this worker. Give it back, so that it is not held by nobody until the sidecar's
   * --worker-timeout: harmless if it was requeued meanwhile (the token is fenced: 409), and it
   * sends no result.
   */
  private async releaseUnconfirmed(): Promise<void> {
    const deadline = performance.now() + Math.max(30, this.leaseDurationSeconds) * 1000;
    try {
      await retrying(() => this.client.release(this.name, this.token, this.callOptions()), deadline);
    } catch (err) {
      this.log.info(`Release of ${this.label} after an unconfirmed lease: ${err instanceof Error ? err.message : String(err)}`);
      return;
    }
    this.ended = "release";
    this.log.info(`Released ${this.label} after its lease went unconfirmed`);
  }

  /** One ending, under the send lock: repeated while unavailable, never after a known loss. */
  private async end(verb: Ending, call: () => Promise<EndAnswer>): Promise<EndAnswer> {
    this.checkOwned();
    const deadline = performance.now() + Math.max(30, this.leaseDurationSeconds) * 1000;
    let answer: EndAnswer;
    try {
      answer = await retrying(call, deadline);
    } catch (err) {
      if (err instanceof JobLost) this.setLost(err);
      else if (err instanceof ConnectionFailed || err instanceof Unavailable) this.gaveUp = true;
      throw err;
    }
    this.ended = verb;
    this.running = false;
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.abort(new JobEnded(`${this.label} attempt ${this.attempt} ended (${verb})`));
    return answer;
  }

  /**
   * The sidecar answers within min(5 s, LD/3); never wait past the lease's end as far as we
   * know, so an unresponsive sidecar is noticed when the lease runs out.
   */
  private callTimeout(): number {
    const normal = Math.min(5, this.leaseDurationSeconds / 3) + 2;
    const left = (this.confirmedAt - performance.now()) / 1000 + this.leaseDurationSeconds;
    return Math.max(1, Math.min(normal, left, CALL_TIMEOUT));
  }

  /**
   * One heartbeat with the pending checkpoint, if any, under the send lock. Throws as
   * {@link heartbeat}, and {@link LeaseUnconfirmed} when it failed and no heartbeat was
   * confirmed for a whole lease.
   */
  private async beat(): Promise<HeartbeatAnswer> {
    this.checkOwned();
    const pending = this.pending;
    this.pending = undefined;
    const sent = performance.now();
    let answer: HeartbeatAnswer;
    try {
      answer = await this.client.heartbeat(this.name, this.token, {
        ...(pending !== undefined ? { checkpoint: pending.value } : {}),
        ...(this.progressValue !== undefined ? { progress: this.progressValue } : {}),
        ...(this.messageValue !== undefined ? { message: this.messageValue } : {}),
        attempt: this.attempt,
        timeout: this.callTimeout(),
      });
    } catch (err) {
      if (err instanceof JobLost) {
        this.setLost(err);
        throw err;
      }
      if (err instanceof ConnectionFailed || err instanceof Unavailable) {
        if (pending !== undefined && this.pending === undefined) this.pending = pending;
        const silent = (performance.now() - this.confirmedAt) / 1000;
        if (silent >= this.leaseDurationSeconds) {
          this.setLost(
            new LeaseUnconfirmed(
              `no heartbeat of ${this.label} (attempt ${this.attempt}) confirmed for ${silent.toFixed(1)} s, ` +
                `its whole lease (${this.leaseDurationSeconds} s): it may have been requeued; last error: ${err.message}`,
            ),
          );
          throw this.lost!;
        }
      }
      throw err;
    }
    this.confirmedAt = sent;
    const duration = answer.leaseDurationSeconds;
    if (typeof duration === "number" && duration > 0) this.leaseDurationSeconds = duration;
    return answer;
  }

  private schedule(seconds: number): void {
    if (!this.running) return;
    this.timer = setTimeout(() => {
      this.timer = undefined;
      this.inFlight = this.beatOnce().finally(() => {
        this.inFlight = undefined;
      });
    }, seconds * 1000);
    // The heartbeats alone do not keep the process alive: the work does.
    this.timer.unref();
  }

  private async beatOnce(): Promise<void> {
    if (!this.running) return;
    let next = this.heartbeatInterval;
    try {
      await this.locked(() => this.beat());
    } catch (err) {
      if (err instanceof JobLost || err instanceof JobEnded) {
        this.running = false;
        return;
      }
      next = Math.min(RETRY_PAUSE, this.heartbeatInterval);
      if (err instanceof ApiError && !(err instanceof Unavailable)) {
        // E.g. TooLarge: the checkpoint was refused; go on without it.
        this.log.error(`Heartbeat of ${this.label} refused: ${err.message}`);
      } else if (!(err instanceof ConnectionFailed || err instanceof Unavailable)) {
        this.log.error(`Heartbeat of ${this.label} failed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
      }
    }
    this.schedule(next);
  }
}

/** Whether `err` is what an aborted operation throws (`AbortError`, or a signal's reason). */
export function isAbortError(err: unknown): boolean {
  return err instanceof Error && (err.name === "AbortError" || err instanceof LeaseholdError);
}

/** `Name: message` of a thrown value, as a failure's message says it. @internal */
export function describeError(err: unknown): string {
  if (err instanceof Error) return `${err.name}: ${err.message}`;
  let text: string;
  try {
    text = JSON.stringify(err) ?? String(err);
  } catch {
    text = typeName(err);
  }
  return `a thrown ${typeName(err)}: ${text}`;
}
