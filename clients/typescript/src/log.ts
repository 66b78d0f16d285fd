/**
 * Where the worker and its jobs log: one line per record.
 *
 * @module
 */

/** A logger: the console, a logging library's logger, or {@link silentLogger}. */
export interface Logger {
  /** Progress worth a line: claimed, ended, stopping. */
  info(message: string): void;
  /** Something went wrong but the worker goes on: a job lost, a claim retried. */
  warn(message: string): void;
  /** A bug or a refusal: a handler threw, a result was not JSON. */
  error(message: string): void;
}

function line(level: string, message: string): void {
  process.stderr.write(`${new Date().toISOString()} ${level} ${message}\n`);
}

/** The default logger: `TIME LEVEL message` lines on stderr. */
export const stderrLogger: Logger = {
  info: (message) => line("INFO", message),
  warn: (message) => line("WARNING", message),
  error: (message) => line("ERROR", message),
};

/** A logger that drops everything. */
export const silentLogger: Logger = {
  info: () => {},
  warn: () => {},
  error: () => {},
};
