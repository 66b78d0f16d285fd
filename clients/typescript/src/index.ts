/**
 * leasehold: a TypeScript client for the leasehold sidecar.
 *
 * A worker in a few lines:
 *
 * ```ts
 * import { run, Fail } from "leasehold";
 *
 * await run(async (job) => {
 *   const items = (job.payload as { items: string[] }).items;
 *   for (let i = (job.checkpoint as number | null) ?? 0; i < items.length; i++) {
 *     await process(items[i], job.signal); // aborts once the lease is lost or the job cancelled
 *     job.save(i + 1);                     // sent with the next heartbeat
 *     job.check();                         // throws once the lease is lost or cancelled
 *   }
 *   return { items: items.length };        // -> complete
 * });                                      // claims until SIGTERM
 * ```
 *
 * See {@link Worker} for how a handler's outcome ends the attempt, {@link Job} for the claimed
 * job, {@link Client} for the raw HTTP calls, and errors.ts for the error of every code. No
 * runtime dependencies; Node 20 or later.
 *
 * @packageDocumentation
 */

export {
  CALL_TIMEOUT,
  CLAIM_SLACK,
  Client,
  DEFAULT_SIDECAR,
  MAX_BODY_BYTES,
  MAX_CLAIM_WAIT,
  MAX_FAIL_MESSAGE_BYTES,
  MAX_REASON_LENGTH,
  MAX_RETRY_AFTER_SECONDS,
  REASON_PATTERN,
  checkFailure,
  retrying,
} from "./client.js";
export type {
  CallOptions,
  ClaimAnswer,
  ClaimOptions,
  ClientOptions,
  EndAnswer,
  Event,
  EventKind,
  FailCallOptions,
  Failure,
  HeartbeatAnswer,
  HeartbeatFields,
} from "./client.js";
export {
  ApiError,
  BodyTimeout,
  Cancelled,
  ConnectionFailed,
  ERRORS,
  Fail,
  InvalidJson,
  InvalidName,
  InvalidRequest,
  InvalidToken,
  JobEnded,
  JobFinished,
  JobLost,
  JobNotFound,
  LeaseLost,
  LeaseUnconfirmed,
  LeaseholdError,
  MethodNotAllowed,
  NotFound,
  RequestRejected,
  ShutdownRequested,
  ShuttingDown,
  TooLarge,
  Unavailable,
  UnexpectedResponse,
  errorFromAnswer,
} from "./errors.js";
export type { ApiErrorClass, ErrorBody, FailOptions } from "./errors.js";
export { HEARTBEAT_FRACTION, Job, MAX_CHECKPOINT_BYTES, MAX_PROGRESS_MESSAGE_BYTES, RETRY_PAUSE } from "./job.js";
export type { Ending, JobOptions } from "./job.js";
export { typeName, whyNotJson } from "./json.js";
export { TRACER_NAME, parseTraceparent, startJobSpan } from "./tracing.js";
export type { JobSpan } from "./tracing.js";
export { silentLogger, stderrLogger } from "./log.js";
export type { Logger } from "./log.js";
export { Worker, run } from "./worker.js";
export type { Handler, ShutdownPolicy, WorkerOptions } from "./worker.js";

/** This package's version: the same as every other leasehold artefact's (docs/versioning.md). */
export const VERSION = "0.1.0";
