// A worker process for the tests: each job is `payload.steps` steps of `payload.stepSeconds`
// seconds, resumed from the checkpoint {step: n}, saving one after each step. Prints every
// client event as a JSON line on stdout (and `started`, with the job's token, when a handler
// starts).
//
// Usage: steps_worker.mjs SIDECAR_URL ON_SHUTDOWN [--max-jobs N] [--concurrency N]

import { Client, run } from "../dist/index.js";

const [sidecar, onShutdown, ...rest] = process.argv.slice(2);
const option = (name, fallback) => {
  const at = rest.indexOf(name);
  return at >= 0 ? Number(rest[at + 1]) : fallback;
};

function emit(event) {
  process.stdout.write(`${JSON.stringify(event)}\n`);
}

const client = new Client({ baseUrl: sidecar, onEvent: emit });

async function handle(job) {
  let step = job.checkpoint?.step ?? 0;
  emit({ kind: "started", name: job.name, attempt: job.attempt, token: job.token, message: `from step ${step}` });
  while (step < job.payload.steps) {
    await job.sleep(job.payload.stepSeconds);
    step += 1;
    job.save({ step });
  }
  return { steps: step, attempt: job.attempt };
}

await run(handle, {
  client,
  wait: 5,
  onShutdown,
  maxJobs: option("--max-jobs", 0),
  concurrency: option("--concurrency", 1),
});
