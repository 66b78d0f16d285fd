/**
 * Errors of the leasehold client: one class per error code of the sidecar's HTTP API.
 *
 * Every answer the sidecar gives with an `{"error": CODE, "message": TEXT}` body becomes an
 * instance of the class registered for CODE (see {@link ERRORS}), carrying the HTTP status,
 * the code and the server's message unchanged. docs/protocol.md ("The sidecar's HTTP API")
 * lists the codes; the classes below follow its table.
 *
 * The classes are grouped by what the worker should do:
 *
 * - {@link JobLost}: the job is no longer this worker's (lease lost, job finished, cancelled,
 *   job deleted, or no renewal confirmed for a whole lease). Stop working on it; send nothing
 *   more for it; claim again.
 * - {@link RequestRejected}: the request itself was wrong (a bug in the caller); repeating it
 *   changes nothing.
 * - {@link Unavailable} and {@link ConnectionFailed}: transient; repeat with the same token.
 * - {@link ShuttingDown}: the sidecar is draining; claim nothing more.
 *
 * @module
 */

/** Base class of every error this package throws. */
export class LeaseholdError extends Error {
  /** @param message - what happened. @param options - `cause`, as for `Error`. */
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/**
 * The sidecar could not be reached, or did not answer within the call's timeout.
 *
 * Transient: repeating the call with the same token is safe (the sidecar answers a repeated
 * complete, fail or release as it answered the first one that landed).
 */
export class ConnectionFailed extends LeaseholdError {}

/** The JSON body of an error answer: `{error, message, ...}`. */
export type ErrorBody = { [key: string]: unknown };

/**
 * An error answer of the sidecar. `message` (the Error's) reads `STATUS CODE: SERVER MESSAGE`;
 * {@link ApiError.serverMessage} is the server's message alone.
 */
export class ApiError extends LeaseholdError {
  /** The error code this class stands for (`undefined` for classes that group several). */
  static readonly code: string | undefined = undefined;
  /** The HTTP status, e.g. 409 (0 for errors raised by this client without an answer). */
  readonly status: number;
  /** The error code of the body, e.g. `"lease_lost"`. */
  readonly code: string;
  /** The server's message, unchanged: what happened, to which job, what to do. */
  readonly serverMessage: string;
  /** The whole JSON body of the answer (`{}` when there was none). */
  readonly body: ErrorBody;

  /**
   * @param status - the HTTP status.
   * @param code - the error code.
   * @param serverMessage - the server's message.
   * @param body - the whole body of the answer.
   */
  constructor(status: number, code: string, serverMessage: string, body?: ErrorBody) {
    super(`${status} ${code}: ${serverMessage}`);
    this.status = status;
    this.code = code;
    this.serverMessage = serverMessage;
    this.body = body ?? {};
  }
}

/**
 * An answer the protocol does not describe: a body that is not a JSON error, or an error code
 * this client does not know (a newer sidecar). `code` is `""` when the body had none.
 */
export class UnexpectedResponse extends ApiError {}

/**
 * The sidecar refused the request as malformed (or this client refused to send it): a bug in
 * the caller, not a condition that repeating the call would change.
 */
export class RequestRejected extends ApiError {}

/** 400 `invalid_json`: the body is not JSON of the expected shape (or has unknown fields). */
export class InvalidJson extends RequestRejected {
  static override readonly code = "invalid_json";
}

/** 400 `invalid_token`: the token is missing or not `<attempt>.<32 hex>`. */
export class InvalidToken extends RequestRejected {
  static override readonly code = "invalid_token";
}

/**
 * 400 `invalid_request`: a field breaks its rule (reason, message, wait, progress,
 * retryAfterSeconds). Also thrown by this client, before sending, for values the sidecar
 * would refuse.
 */
export class InvalidRequest extends RequestRejected {
  static override readonly code = "invalid_request";
}

/** 400 `invalid_name`: the job name in the URL is not a valid object name. */
export class InvalidName extends RequestRejected {
  static override readonly code = "invalid_name";
}

/** 404 `not_found`: no such route (a client for another version of the API?). */
export class NotFound extends RequestRejected {
  static override readonly code = "not_found";
}

/** 405 `method_not_allowed`: a GET where a POST is expected, or the reverse. */
export class MethodNotAllowed extends RequestRejected {
  static override readonly code = "method_not_allowed";
}

/**
 * 408 `body_timeout`: the request body did not arrive in full within the sidecar's
 * `--body-timeout` (10 s).
 */
export class BodyTimeout extends RequestRejected {
  static override readonly code = "body_timeout";
}

/**
 * 413 `too_large`: the body is over 1 MiB, the checkpoint over 64 KiB, or the result would
 * make the job larger than 1 MiB as JSON. Nothing was written; the job is still held, so a
 * smaller result (e.g. a reference to an object store) can be sent instead. Also thrown by
 * this client, before sending, for a body or checkpoint over the limit.
 */
export class TooLarge extends RequestRejected {
  static override readonly code = "too_large";
}

/**
 * The job is no longer this worker's. Stop working on it and send nothing more for it: the
 * server refuses every write with this token from now on.
 */
export class JobLost extends ApiError {}

/**
 * 409 `lease_lost`: the token is not the current holder's (stale, another job's, or the
 * attempt ended: expired or released). The message gives the current attempt.
 */
export class LeaseLost extends JobLost {
  static override readonly code = "lease_lost";
}

/** 409 `job_finished`: the job is already Succeeded or Failed. */
export class JobFinished extends JobLost {
  static override readonly code = "job_finished";
}

/** 409 `cancelled`: the job was cancelled (`spec.cancel`); its outcome is Cancelled. */
export class Cancelled extends JobLost {
  static override readonly code = "cancelled";
}

/** 404 `job_not_found`: no such LeasedJob (deleted while held). */
export class JobNotFound extends JobLost {
  static override readonly code = "job_not_found";
}

/**
 * Thrown by this client, not answered by the sidecar: no heartbeat was confirmed for a whole
 * lease (`leaseDurationSeconds`, counted from when the last confirmed heartbeat was sent),
 * while heartbeats failed (sidecar unreachable or answering `unavailable`). The controller may
 * have requeued the job meanwhile, so the client treats it as lost and sends no result for it.
 * `status` is 0 and `code` `"lease_unconfirmed"`.
 */
export class LeaseUnconfirmed extends JobLost {
  static override readonly code = "lease_unconfirmed";
  /** @param message - what happened. */
  constructor(message: string) {
    super(0, "lease_unconfirmed", message);
  }
}

/**
 * 503 `unavailable`: the API server could not be reached or did not answer in time (or, for a
 * claim, the sidecar's watch has not synced yet). Transient: repeat the call with the same
 * token.
 */
export class Unavailable extends ApiError {
  static override readonly code = "unavailable";
  /**
   * For a held job, when its lease runs out unless a renewal gets through, as far as the
   * sidecar knows (RFC 3339, the sidecar's clock); `undefined` when the answer had none.
   */
  readonly expiresAt: string | undefined;
  /** @see ApiError */
  constructor(status: number, code: string, serverMessage: string, body?: ErrorBody) {
    super(status, code, serverMessage, body);
    const expires = this.body["expiresAt"];
    this.expiresAt = typeof expires === "string" ? expires : undefined;
  }
}

/**
 * 503 `shutting_down` (claim only): the sidecar is draining and claims nothing more; jobs
 * already held can still be heartbeated, completed, failed and released.
 */
export class ShuttingDown extends ApiError {
  static override readonly code = "shutting_down";
}

/**
 * Thrown by this client: a call on a {@link Job} that this worker already completed, failed
 * or released (each attempt ends once).
 */
export class JobEnded extends LeaseholdError {}

/**
 * The reason `job.signal` aborts with, and what {@link Job.check} throws, once the worker was
 * asked to stop (SIGTERM or SIGINT) and its shutdown policy is `"release"`: the worker then
 * releases the job, with its latest checkpoint, so another worker resumes it at once. A handler
 * may catch it to clean up, but should let it propagate.
 */
export class ShutdownRequested extends LeaseholdError {}

/** Options of {@link Fail}. */
export interface FailOptions {
  /**
   * Whether another attempt could succeed. `false` (the default) ends the job Failed at once;
   * `true` requeues it (after its backoff) until `maxAttempts` failed attempts were used.
   */
  retryable?: boolean;
  /**
   * With `retryable: true` only: the earliest the next attempt may start, in whole seconds
   * from now (0..86400), instead of the job's backoff. Needs a sidecar that knows the field.
   */
  retryAfterSeconds?: number;
}

/**
 * Throw from a handler to end the attempt as failed:
 * `throw new Fail("BadPayload", "payload.input: missing", { retryable: false })`.
 */
export class Fail extends LeaseholdError {
  /** A CamelCase word, `^[A-Za-z][A-Za-z0-9]*$`, at most 64 characters, e.g. `"BadPayload"`. */
  readonly reason: string;
  /** Whether another attempt could succeed. */
  readonly retryable: boolean;
  /** The delay before the next attempt, in seconds, if one was asked for. */
  readonly retryAfterSeconds: number | undefined;

  /**
   * @param reason - a CamelCase word, `^[A-Za-z][A-Za-z0-9]*$`, at most 64 characters.
   * @param message - what happened, at most 4096 bytes of UTF-8 (longer is cut).
   * @param options - `retryable` and `retryAfterSeconds`.
   */
  constructor(reason: string, message: string = "", options: FailOptions = {}) {
    super(message);
    this.reason = reason;
    this.retryable = options.retryable ?? false;
    this.retryAfterSeconds = options.retryAfterSeconds;
  }
}

/** A class of {@link ApiError} constructible from an answer. */
export type ApiErrorClass = new (
  status: number,
  code: string,
  serverMessage: string,
  body?: ErrorBody,
) => ApiError;

/** Error code -> error class, for every code docs/protocol.md documents. */
export const ERRORS: Readonly<Record<string, ApiErrorClass>> = Object.freeze(
  Object.fromEntries(
    [
      InvalidJson,
      InvalidToken,
      InvalidRequest,
      InvalidName,
      JobNotFound,
      NotFound,
      MethodNotAllowed,
      BodyTimeout,
      LeaseLost,
      JobFinished,
      Cancelled,
      TooLarge,
      Unavailable,
      ShuttingDown,
    ].map((cls) => [cls.code, cls as ApiErrorClass]),
  ),
);

/**
 * The error for an error answer: the registered class for its code, else
 * {@link UnexpectedResponse}.
 *
 * @param status - the HTTP status.
 * @param body - the parsed JSON body (or `undefined` when there was none).
 */
export function errorFromAnswer(status: number, body: unknown): ApiError {
  if (isObject(body) && typeof body["error"] === "string") {
    const code = body["error"];
    const message = typeof body["message"] === "string" ? body["message"] : "";
    const cls = Object.prototype.hasOwnProperty.call(ERRORS, code) ? ERRORS[code]! : UnexpectedResponse;
    return new cls(status, code, message, body);
  }
  const shown = body === undefined ? "an empty body" : JSON.stringify(body).slice(0, 200);
  return new UnexpectedResponse(status, "", `HTTP ${status} with ${shown}`);
}

/** Whether `value` is a non-null, non-array object. @internal */
export function isObject(value: unknown): value is { [key: string]: unknown } {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}
