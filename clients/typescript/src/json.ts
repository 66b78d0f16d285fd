/**
 * Strict JSON: what a result or checkpoint may be, checked before it is sent.
 *
 * @module
 */

/** The name of `value`'s type as an error message shows it: `Map`, `bigint`, `Transcript`. */
export function typeName(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "Array";
  if (typeof value === "object") {
    const proto = Object.getPrototypeOf(value) as { constructor?: { name?: string } } | null;
    return proto?.constructor?.name || "Object";
  }
  return typeof value;
}

/**
 * Why `value` is not strict JSON, or `undefined` when it is: `null`, booleans, finite numbers,
 * strings, arrays of JSON and plain objects of JSON (an `undefined` property is left out, as
 * `JSON.stringify` does), and objects with a `toJSON` method (a `Date`) whose value is JSON.
 * Refused: `undefined` (but in an object property), `NaN` and infinities, bigints, symbols,
 * functions, cycles, and objects of other classes (`Map`, `Set`, class instances), which
 * `JSON.stringify` would turn into `{}` or refuse.
 */
export function whyNotJson(value: unknown): string | undefined {
  const seen = new Set<object>();
  const visit = (v: unknown, at: string): string | undefined => {
    switch (typeof v) {
      case "string":
      case "boolean":
        return undefined;
      case "number":
        return Number.isFinite(v) ? undefined : `${where(at)}${String(v)} is not a JSON number`;
      case "undefined":
        return `${where(at)}undefined is not JSON`;
      case "bigint":
      case "symbol":
      case "function":
        return `${where(at)}a ${typeof v} is not JSON`;
    }
    if (v === null) return undefined;
    const obj = v as object;
    const toJSON = (obj as { toJSON?: unknown }).toJSON;
    if (typeof toJSON === "function") {
      return visit((toJSON as (key: string) => unknown).call(obj, ""), at);
    }
    if (seen.has(obj)) return `${where(at)}a cycle (the value contains itself) is not JSON`;
    seen.add(obj);
    try {
      if (Array.isArray(obj)) {
        for (let i = 0; i < obj.length; i++) {
          const why = visit(obj[i], `${at}[${i}]`);
          if (why !== undefined) return why;
        }
        return undefined;
      }
      const proto = Object.getPrototypeOf(obj);
      if (proto !== Object.prototype && proto !== null) {
        return `${where(at)}an object of type ${typeName(obj)} is not JSON (only null, booleans, finite numbers, strings, arrays and plain objects are)`;
      }
      for (const [key, item] of Object.entries(obj)) {
        if (item === undefined) continue;
        const why = visit(item, `${at}.${key}`);
        if (why !== undefined) return why;
      }
      return undefined;
    } finally {
      seen.delete(obj);
    }
  };
  return visit(value, "");
}

function where(at: string): string {
  return at ? `at ${at}: ` : "";
}
