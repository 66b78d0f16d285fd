/**
 * Traces across the queue, with OpenTelemetry when `@opentelemetry/api` is installed (an
 * optional peer dependency; docs/protocol.md, "Traces across the queue").
 *
 * A producer puts its span's W3C `traceparent` on the job (the annotation
 * `leasehold.dev/traceparent`), the sidecar hands it to the worker with the claim
 * ({@link Job.traceparent}), and {@link Worker} runs the handler inside a span whose parent is
 * the producer's span, current (`context.with`) while the handler runs:
 *
 * - name `leasehold.job <queue>` (the job's name when the sidecar does not say its queue), kind
 *   CONSUMER;
 * - attributes of OpenTelemetry's messaging conventions: `messaging.system` = `"leasehold"`,
 *   `messaging.operation.type` = `"process"`, `messaging.destination.name` = the queue,
 *   `messaging.message.id` = the job's name, plus `leasehold.namespace`, `leasehold.attempt`
 *   (from 1) and, once the attempt ended, `leasehold.outcome` (`complete`, `fail`,
 *   `release`);
 * - the exception recorded and the status ERROR when the handler throws (a {@link Fail}
 *   included) or the attempt ends failed; a job handed back on shutdown or cancelled is not an
 *   error.
 *
 * Parent rather than link: a claim hands one job to one handler, the single-message case for
 * which the messaging conventions make the producer's context the consumer span's parent
 * (links are for batches). A job without a (valid) traceparent gets a root span.
 *
 * The parent is extracted with the registered propagator (`propagation.extract`); when that
 * yields no span context (the API alone registers none, or the application's propagator is
 * not W3C), the traceparent is parsed here and set with `trace.setSpanContext`. The span is
 * current in the handler only if a context manager is registered (an SDK's
 * `NodeTracerProvider`, or `AsyncLocalStorageContextManager`).
 *
 * Without `@opentelemetry/api`, nothing of it is imported (the import is dynamic, and fails
 * quietly): no span, and the handler runs as it would anyway.
 *
 * @module
 */

import type * as OtelApi from "@opentelemetry/api";

import type { Job } from "./job.js";

type Otel = typeof OtelApi;

/** The instrumentation scope of the spans made here. */
export const TRACER_NAME = "leasehold";

// W3C Trace Context, version 00 (section 3.2.2): lowercase hex, neither id all zeros.
const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/** A W3C traceparent's fields, or `undefined` when `value` is not a valid one of version 00. */
export function parseTraceparent(
  value: unknown,
): { traceId: string; spanId: string; traceFlags: number } | undefined {
  if (typeof value !== "string") return undefined;
  const m = TRACEPARENT.exec(value);
  if (m === null || /^0+$/.test(m[1]!) || /^0+$/.test(m[2]!)) return undefined;
  return { traceId: m[1]!, spanId: m[2]!, traceFlags: parseInt(m[3]!, 16) };
}

let loading: Promise<Otel | undefined> | undefined;

/**
 * The OpenTelemetry API, or `undefined` when `@opentelemetry/api` cannot be imported (not
 * installed). Imported once, on first use. (Not exported: this package's declarations name
 * no type of OpenTelemetry's, so that they compile without it.)
 */
function loadOpenTelemetry(): Promise<Otel | undefined> {
  loading ??= import("@opentelemetry/api").then(
    (api) => api,
    () => undefined,
  );
  return loading;
}

/** The span of one attempt (see the module). */
export interface JobSpan {
  /** Runs `fn` with the span current (`context.with`). */
  run<T>(fn: () => T): T;
  /**
   * Records an error the handler threw, and sets the status ERROR; the caller leaves out a
   * shutdown's or a cancellation's, which are not errors of the attempt.
   */
  error(err: unknown): void;
  /** Ends the span, saying how the attempt ended. */
  end(): void;
}

/**
 * The span of `job`'s attempt, started now; `undefined` without OpenTelemetry. Never throws:
 * tracing must not cost a job.
 */
export async function startJobSpan(job: Job): Promise<JobSpan | undefined> {
  const api = await loadOpenTelemetry();
  if (api === undefined) return undefined;
  try {
    return makeSpan(api, job);
  } catch {
    return undefined;
  }
}

function parentContext(api: Otel, job: Job): OtelApi.Context {
  const root = api.ROOT_CONTEXT;
  const parsed = parseTraceparent(job.traceparent);
  if (parsed === undefined) return root;
  const carrier: Record<string, string> = { traceparent: job.traceparent! };
  if (job.tracestate !== undefined) carrier["tracestate"] = job.tracestate;
  const extracted = api.propagation.extract(root, carrier);
  const found = api.trace.getSpanContext(extracted);
  if (found !== undefined && api.isSpanContextValid(found) && found.traceId === parsed.traceId) {
    return extracted;
  }
  // No W3C propagator registered (the API alone has a no-op one): the claim's fields are W3C.
  const spanContext: OtelApi.SpanContext = { ...parsed, isRemote: true };
  if (job.tracestate !== undefined && typeof api.createTraceState === "function") {
    spanContext.traceState = api.createTraceState(job.tracestate);
  }
  return api.trace.setSpanContext(root, spanContext);
}

function makeSpan(api: Otel, job: Job): JobSpan {
  const parent = parentContext(api, job);
  const attributes: OtelApi.Attributes = {
    "messaging.system": "leasehold",
    "messaging.operation.type": "process",
    "messaging.message.id": job.name,
    "leasehold.attempt": job.attempt,
  };
  if (job.queue !== undefined) attributes["messaging.destination.name"] = job.queue;
  if (job.namespace) attributes["leasehold.namespace"] = job.namespace;
  const span = api.trace
    .getTracer(TRACER_NAME)
    .startSpan(`leasehold.job ${job.queue ?? job.name}`, { kind: api.SpanKind.CONSUMER, attributes }, parent);
  const current = api.trace.setSpan(parent, span);
  let errored = false;
  let ended = false;
  const setError = (message: string) => {
    if (errored) return;
    errored = true;
    span.setStatus({ code: api.SpanStatusCode.ERROR, message });
  };
  return {
    run: (fn) => api.context.with(current, fn),
    error(err) {
      if (err instanceof Error) {
        span.recordException(err);
        setError(`${err.name}: ${err.message}`);
      } else {
        span.recordException(String(err));
        setError(String(err));
      }
    },
    end() {
      if (ended) return;
      ended = true;
      if (job.ended !== undefined) span.setAttribute("leasehold.outcome", job.ended);
      if (job.ended === "fail") setError("the attempt failed");
      span.end();
    },
  };
}
