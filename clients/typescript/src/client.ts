/**
 * The sidecar's HTTP API, one method per call (docs/protocol.md, "The sidecar's HTTP API").
 *
 * {@link Client} is the thin layer: it sends one request, turns an error answer into the typed
 * error of its code (see errors.ts), and reports every exchange to an optional listener. It
 * keeps no state about jobs; {@link Job} does.
 *
 * @module
 */

import {
  ConnectionFailed,
  InvalidRequest,
  TooLarge,
  Unavailable,
  errorFromAnswer,
  isObject,
} from "./errors.js";

/** The sidecar's address when neither the option nor `$LEASEHOLD_SIDECAR` gives one. */
export const DEFAULT_SIDECAR = "http://127.0.0.1:7070";
/** Longest long poll the sidecar accepts for a claim, in seconds. */
export const MAX_CLAIM_WAIT = 300;
/**
 * Seconds added to a claim's `wait` for its HTTP timeout: the sidecar may take up to
 * min(5 s, leaseDurationSeconds / 3) for each of the claim's two writes beyond the wait.
 */
export const CLAIM_SLACK = 15;
/** The sidecar refuses a request body over this many bytes. */
export const MAX_BODY_BYTES = 1024 * 1024;
/**
 * Default HTTP timeout of heartbeat, complete, fail and release, in seconds. The sidecar
 * answers each within min(5 s, leaseDurationSeconds / 3).
 */
export const CALL_TIMEOUT = 10;
/** A failure's `reason`: a CamelCase word. */
export const REASON_PATTERN = /^[A-Za-z][A-Za-z0-9]*$/;
/** Longest `reason`, in characters. */
export const MAX_REASON_LENGTH = 64;
/** Longest failure `message`, in bytes of UTF-8 (longer is cut by this client). */
export const MAX_FAIL_MESSAGE_BYTES = 4096;
/** Largest `retryAfterSeconds` of a failure: one day. */
export const MAX_RETRY_AFTER_SECONDS = 86400;

/** One earlier failed attempt of a job, as a newer sidecar's claim answer lists them. */
export interface Failure {
  /** The attempt that failed. */
  attempt: number;
  /** Who held it (the sidecar's identity). */
  holder: string;
  /** The failure's reason, e.g. `"WorkerError"` or `"LeaseExpired"`. */
  reason: string;
  /** What happened. */
  message: string;
  /** When, RFC 3339. */
  time: string;
}

/**
 * The sidecar's answer to a claim. `maxAttempts`, `failures` and `lastAttempt` come from newer
 * sidecars only; any other field a newer sidecar adds is kept too.
 */
export interface ClaimAnswer {
  /** The LeasedJob's namespace. */
  namespace: string;
  /** The LeasedJob's name. */
  name: string;
  /** The attempt number, from 1. */
  attempt: number;
  /** The fencing token of this attempt (`<attempt>.<32 hex>`). */
  token: string;
  /** `spec.payload`, any JSON. */
  payload: unknown;
  /** The lease's duration, in seconds. */
  leaseDurationSeconds: number;
  /** The checkpoint to resume from (the last one saved), or `null` for a fresh start. */
  checkpoint: unknown;
  /** How many failed attempts end the job (newer sidecars). */
  maxAttempts?: number;
  /** Earlier failed attempts, oldest first (newer sidecars). */
  failures?: Failure[];
  /** Whether a failure of this attempt ends the job (newer sidecars). */
  lastAttempt?: boolean;
  /** The job's queue (newer sidecars). */
  queue?: string;
  /** The producer's W3C traceparent, when the job carries a valid one (newer sidecars). */
  traceparent?: string;
  /** The producer's W3C tracestate, only beside a traceparent. */
  tracestate?: string;
  /** Fields this client does not know. */
  [field: string]: unknown;
}

/** The answer to a heartbeat. */
export interface HeartbeatAnswer {
  /** When the lease was renewed (RFC 3339, the sidecar's clock). */
  renewTime: string;
  /** `renewTime + leaseDurationSeconds`: a guide, not a promise. */
  expiresAt: string;
  /** The lease's duration, in seconds. */
  leaseDurationSeconds: number;
  /** Fields this client does not know. */
  [field: string]: unknown;
}

/** The answer to complete, fail and release. */
export interface EndAnswer {
  /** The job's namespace. */
  namespace: string;
  /** The job's name. */
  name: string;
  /** The attempt that ended. */
  attempt: number;
  /** The job's phase now: `"Succeeded"`, `"Queued"` (retried or released) or `"Failed"`. */
  phase: string;
  /** Fields this client does not know. */
  [field: string]: unknown;
}

/** What a call did, for logs and metrics (see {@link ClientOptions.onEvent}). */
export type EventKind =
  | "claimed"
  | "idle"
  | "heartbeat"
  | "complete"
  | "fail"
  | "release"
  | "lost"
  | "error";

/** One thing the client did. */
export interface Event {
  /**
   * `"claimed"`, `"idle"` (a claim found nothing), `"heartbeat"`, `"complete"`, `"fail"`,
   * `"release"` (one per HTTP exchange, retries included), `"lost"` (an attempt ended without
   * an accepted outcome) or `"error"` (a call that got no answer, or an error outside any job).
   */
  kind: EventKind;
  /** The job's name. */
  name?: string;
  /** The job's attempt. */
  attempt?: number;
  /** The HTTP status of the answer; absent when there was none. */
  status?: number;
  /** The answer's error code (`"lease_lost"`, ...). */
  error?: string;
  /** For a heartbeat, the checkpoint it carried. */
  checkpoint?: unknown;
  /** For errors and `lost`, what happened. */
  message?: string;
}

/** Options of {@link Client}. */
export interface ClientOptions {
  /**
   * The sidecar's base URL, e.g. `"http://127.0.0.1:7070"`; default `$LEASEHOLD_SIDECAR`,
   * else {@link DEFAULT_SIDECAR}.
   */
  baseUrl?: string;
  /** Called with an {@link Event} after every exchange. It must not throw. */
  onEvent?: (event: Event) => void;
}

/** Per-call options of the job calls. */
export interface CallOptions {
  /** The job's attempt, for events only. */
  attempt?: number;
  /** HTTP timeout in seconds; default {@link CALL_TIMEOUT}. */
  timeout?: number;
}

/** What a heartbeat carries besides the token. */
export interface HeartbeatFields extends CallOptions {
  /** A checkpoint to store (any JSON, at most 64 KiB encoded); absent keeps the last one. */
  checkpoint?: unknown;
  /** The fraction done, 0 to 1. */
  progress?: number;
  /** A short message for people (at most 256 bytes of UTF-8, no control characters). */
  message?: string;
}

/** Options of {@link Client.fail}. */
export interface FailCallOptions extends CallOptions {
  /** Whether another attempt could succeed; default false. */
  retryable?: boolean;
  /**
   * With `retryable: true` only: whole seconds (0..86400) before the next attempt may start,
   * instead of the job's backoff. Sent only when given.
   */
  retryAfterSeconds?: number;
}

/** Options of {@link Client.claim}. */
export interface ClaimOptions {
  /** Aborts the long poll (the sidecar then gives back a job it claimed meanwhile). */
  signal?: AbortSignal;
}

/**
 * A client for one sidecar. Every method throws {@link ConnectionFailed} when the sidecar does
 * not answer in time or cannot be reached, and the class of the answer's code (errors.ts) for
 * an error answer.
 */
export class Client {
  /** The sidecar's base URL, without a trailing slash. */
  readonly baseUrl: string;
  private readonly onEvent: ((event: Event) => void) | undefined;

  /**
   * @param options - `baseUrl` and `onEvent`; a string is taken as the base URL.
   * @throws TypeError when the URL is not `http(s)://HOST[:PORT]`.
   */
  constructor(options: ClientOptions | string = {}) {
    const opts: ClientOptions = typeof options === "string" ? { baseUrl: options } : options;
    const base = opts.baseUrl || process.env["LEASEHOLD_SIDECAR"] || DEFAULT_SIDECAR;
    let url: URL;
    try {
      url = new URL(base);
    } catch {
      throw new TypeError(`sidecar URL ${JSON.stringify(base)}: expected http://HOST:PORT`);
    }
    if ((url.protocol !== "http:" && url.protocol !== "https:") || !url.hostname) {
      throw new TypeError(`sidecar URL ${JSON.stringify(base)}: expected http://HOST:PORT`);
    }
    this.baseUrl = base.replace(/\/+$/, "");
    this.onEvent = opts.onEvent;
  }

  /**
   * Claims a job of the sidecar's queue, long-polling up to `wait` seconds.
   *
   * @param wait - seconds to wait for a claimable job, 0..300 (fractions are rounded down).
   * @param options - `signal` to abort the long poll.
   * @returns the claim answer, or `null` when nothing was claimable in time (204).
   * @throws {@link ShuttingDown} the sidecar is draining. {@link Unavailable}: its watch has
   * not synced, or the API server failed. {@link InvalidRequest}: `wait` out of range.
   */
  async claim(wait: number = 20, options: ClaimOptions = {}): Promise<ClaimAnswer | null> {
    const seconds = Math.floor(wait);
    const [status, body] = await this.post(
      `/v1/claim?wait=${seconds}`,
      undefined,
      seconds + CLAIM_SLACK,
      options.signal,
    );
    if (status === 204) {
      this.emit({ kind: "idle", status });
      return null;
    }
    if (status !== 200) {
      const error = errorFromAnswer(status, body);
      this.emit({ kind: "error", status, error: error.code, message: error.message });
      throw error;
    }
    if (!isObject(body) || typeof body["name"] !== "string" || typeof body["token"] !== "string") {
      const error = errorFromAnswer(status, body);
      this.emit({ kind: "error", status, message: `claim: malformed answer: ${error.message}` });
      throw error;
    }
    const answer = body as ClaimAnswer;
    this.emit({ kind: "claimed", name: answer.name, attempt: answer.attempt, status });
    return answer;
  }

  /**
   * Renews the lease of job `name`, storing `checkpoint` for the next attempt to resume from
   * when given, and `progress` and `message` for people to see (`kubectl leasehold get`). All
   * of it is written with the renewal itself: one write to the Lease.
   *
   * @returns `{renewTime, expiresAt, leaseDurationSeconds}`.
   * @throws {@link JobLost} (LeaseLost, Cancelled, JobFinished, JobNotFound): stop working on
   * it. {@link Unavailable}: not confirmed in time; repeat. {@link TooLarge}: the checkpoint is
   * over 64 KiB. {@link InvalidRequest}: `progress` or `message` breaks its rule.
   */
  async heartbeat(name: string, token: string, fields: HeartbeatFields = {}): Promise<HeartbeatAnswer> {
    const body: Record<string, unknown> = { token };
    if (fields.checkpoint !== undefined) body["checkpoint"] = fields.checkpoint;
    if (fields.progress !== undefined) body["progress"] = fields.progress;
    if (fields.message !== undefined) body["message"] = fields.message;
    return (await this.jobCall("heartbeat", name, body, fields, fields.checkpoint)) as HeartbeatAnswer;
  }

  /**
   * Ends the attempt as Succeeded with `result` (any JSON; the whole job must stay under
   * 1 MiB as JSON).
   *
   * @returns `{namespace, name, attempt, phase: "Succeeded"}`.
   * @throws {@link JobLost}: the result was refused. {@link TooLarge}: the result would make
   * the job too large (nothing was written; the job is still held). {@link Unavailable}:
   * repeat with the same token.
   */
  async complete(name: string, token: string, result: unknown = null, options: CallOptions = {}): Promise<EndAnswer> {
    return (await this.jobCall("complete", name, { token, result: result ?? null }, options)) as EndAnswer;
  }

  /**
   * Ends the attempt as failed. Checks `reason` and `retryAfterSeconds` before sending, and
   * cuts `message` to 4096 bytes of UTF-8 at a character boundary.
   *
   * @param reason - CamelCase word, `^[A-Za-z][A-Za-z0-9]*$`, at most 64 characters.
   * @param message - what happened.
   * @param options - `retryable` (default false) and `retryAfterSeconds`.
   * @returns `{namespace, name, attempt, phase}`, phase `"Queued"` (retried) or `"Failed"`.
   * @throws {@link InvalidRequest}: a bad reason or retryAfterSeconds (nothing sent).
   * {@link JobLost}, {@link Unavailable}, {@link TooLarge}: as for complete.
   */
  async fail(
    name: string,
    token: string,
    reason: string,
    message: string = "",
    options: FailCallOptions = {},
  ): Promise<EndAnswer> {
    checkFailure(reason, options.retryable ?? false, options.retryAfterSeconds);
    const body: Record<string, unknown> = {
      token,
      reason,
      message: cutUtf8(String(message), MAX_FAIL_MESSAGE_BYTES),
      retryable: options.retryable ?? false,
    };
    if (options.retryAfterSeconds !== undefined) body["retryAfterSeconds"] = options.retryAfterSeconds;
    return (await this.jobCall("fail", name, body, options)) as EndAnswer;
  }

  /**
   * Gives the job back: it is requeued at once with its last checkpoint, and the release does
   * not count as a failed attempt.
   *
   * @returns `{namespace, name, attempt, phase: "Queued"}`.
   * @throws {@link JobLost}, {@link Unavailable}: as for complete.
   */
  async release(name: string, token: string, options: CallOptions = {}): Promise<EndAnswer> {
    return (await this.jobCall("release", name, { token }, options)) as EndAnswer;
  }

  /**
   * Reports `event` to the listener given as `onEvent` (used by {@link Job} and
   * {@link Worker} for the events that are not a single exchange, e.g. `lost`).
   */
  emit(event: Event): void {
    if (this.onEvent !== undefined) this.onEvent(event);
  }

  /**
   * One call on a job: `POST /v1/jobs/{name}/{verb}` with `body`. Exposed for tests and for
   * calls this client does not know yet.
   *
   * @returns the answer's JSON object.
   */
  async jobCall(
    verb: string,
    name: string,
    body: Record<string, unknown>,
    options: CallOptions = {},
    checkpoint?: unknown,
  ): Promise<Record<string, unknown>> {
    const path = `/v1/jobs/${encodeURIComponent(name)}/${verb}`;
    const base: Event = { kind: verb as EventKind, name };
    if (options.attempt !== undefined) base.attempt = options.attempt;
    if (checkpoint !== undefined) base.checkpoint = checkpoint;
    let status: number;
    let answer: unknown;
    try {
      [status, answer] = await this.post(path, body, options.timeout ?? CALL_TIMEOUT);
    } catch (err) {
      if (err instanceof ConnectionFailed) this.emit({ ...base, message: err.message });
      throw err;
    }
    if (status === 200 && isObject(answer)) {
      this.emit({ ...base, status });
      return answer;
    }
    const error = errorFromAnswer(status, answer);
    const event: Event = { ...base, status, message: error.serverMessage };
    if (error.code) event.error = error.code;
    this.emit(event);
    throw error;
  }

  private async post(
    path: string,
    body: unknown,
    timeoutSeconds: number,
    signal?: AbortSignal,
  ): Promise<[number, unknown]> {
    const data = body === undefined ? "" : JSON.stringify(body);
    const size = Buffer.byteLength(data, "utf8");
    if (size > MAX_BODY_BYTES) {
      throw new TooLarge(
        413,
        "too_large",
        `request body of ${size} bytes is larger than the sidecar's limit of ${MAX_BODY_BYTES} bytes ` +
          "(not sent): keep results and checkpoints small, with references to large data",
      );
    }
    const url = this.baseUrl + path;
    const timeout = AbortSignal.timeout(Math.max(1, Math.round(timeoutSeconds * 1000)));
    const signals = signal === undefined ? [timeout] : [timeout, signal];
    let status: number;
    let raw: string;
    try {
      const response = await fetch(url, {
        method: "POST",
        headers: { "content-type": "application/json", accept: "application/json" },
        body: data,
        signal: anySignal(signals),
      });
      status = response.status;
      raw = await response.text();
    } catch (err) {
      let why: string;
      if (timeout.aborted) why = `no answer within ${timeoutSeconds} s`;
      else if (signal?.aborted) why = "aborted";
      else why = describe(err);
      throw new ConnectionFailed(`POST ${url}: ${why}`, { cause: err });
    }
    if (!raw) return [status, undefined];
    try {
      return [status, JSON.parse(raw)];
    } catch {
      return [status, { raw: raw.slice(0, 200) }];
    }
  }
}

/**
 * Runs `call` until it resolves, repeating it after {@link ConnectionFailed} or
 * {@link Unavailable} (both safe to repeat with the same token) with exponential backoff from
 * `pause` to `maxPause` seconds, until `deadline` (`performance.now()` milliseconds); then the
 * last error is thrown. Every other error is thrown at once.
 */
export async function retrying<T>(
  call: () => Promise<T>,
  deadline: number,
  pause: number = 0.5,
  maxPause: number = 4,
): Promise<T> {
  for (;;) {
    try {
      return await call();
    } catch (err) {
      if (!(err instanceof ConnectionFailed || err instanceof Unavailable)) throw err;
      if (performance.now() + pause * 1000 > deadline) throw err;
    }
    await new Promise((resolve) => setTimeout(resolve, pause * 1000));
    pause = Math.min(pause * 2, maxPause);
  }
}

/**
 * Checks a failure's fields as the sidecar would, so that a failure is never refused for them.
 *
 * @throws {@link InvalidRequest} naming the field, the value and the rule.
 */
export function checkFailure(reason: unknown, retryable: boolean, retryAfterSeconds?: unknown): void {
  if (typeof reason !== "string" || !REASON_PATTERN.test(reason) || reason.length > MAX_REASON_LENGTH) {
    throw new InvalidRequest(
      400,
      "invalid_request",
      `reason ${JSON.stringify(reason)} is not a CamelCase word: expected ^[A-Za-z][A-Za-z0-9]*$, ` +
        `at most ${MAX_REASON_LENGTH} characters (e.g. "BadPayload")`,
    );
  }
  if (typeof retryable !== "boolean") {
    throw new InvalidRequest(400, "invalid_request", `retryable ${JSON.stringify(retryable)} is not a boolean`);
  }
  if (retryAfterSeconds === undefined) return;
  if (
    typeof retryAfterSeconds !== "number" ||
    !Number.isInteger(retryAfterSeconds) ||
    retryAfterSeconds < 0 ||
    retryAfterSeconds > MAX_RETRY_AFTER_SECONDS
  ) {
    throw new InvalidRequest(
      400,
      "invalid_request",
      `retryAfterSeconds ${String(retryAfterSeconds)} is out of range: expected a whole number of seconds ` +
        `from 0 to ${MAX_RETRY_AFTER_SECONDS}`,
    );
  }
  if (!retryable) {
    throw new InvalidRequest(
      400,
      "invalid_request",
      `retryAfterSeconds ${retryAfterSeconds} given for a failure that is not retryable: ` +
        "it only delays a next attempt (set retryable: true, or drop it)",
    );
  }
}

/** `text` cut to at most `limit` bytes of UTF-8, at a character boundary. @internal */
export function cutUtf8(text: string, limit: number): string {
  const data = Buffer.from(text, "utf8");
  if (data.length <= limit) return text;
  let end = limit;
  // Back off from a continuation byte (10xxxxxx) to the start of its character.
  while (end > 0 && (data[end]! & 0xc0) === 0x80) end -= 1;
  return data.subarray(0, end).toString("utf8");
}

/** An AbortSignal that aborts when any of `signals` does (AbortSignal.any where present). */
function anySignal(signals: AbortSignal[]): AbortSignal {
  if (signals.length === 1) return signals[0]!;
  const any = (AbortSignal as unknown as { any?: (s: AbortSignal[]) => AbortSignal }).any;
  if (any !== undefined) return any.call(AbortSignal, signals);
  const controller = new AbortController();
  for (const s of signals) {
    if (s.aborted) {
      controller.abort(s.reason);
      break;
    }
    s.addEventListener("abort", () => controller.abort(s.reason), { once: true });
  }
  return controller.signal;
}

/** A one-line description of a fetch failure, with its cause. */
function describe(err: unknown): string {
  if (err instanceof Error) {
    const cause = err.cause instanceof Error ? `: ${err.cause.message}` : "";
    return `${err.message}${cause}`;
  }
  return String(err);
}
