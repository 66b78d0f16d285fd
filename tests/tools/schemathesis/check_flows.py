"""Checks the live sidecar's answers along a worker's real paths against the OpenAPI document
it serves: claim, heartbeat (with progress), complete, fail, release, and the documented
errors each can give. Every answer's status must be documented for its operation, its
Content-Type must be the documented one, and its body must validate against the documented
schema (JSON Schema 2020-12, with jsonschema_rs, the validator schemathesis itself uses). Fuzzing with
schemathesis reaches the error paths with generated requests; this reaches the success paths,
which need real tokens.

Usage: check_flows.py BASE_URL DOC_PATH   (run by tests/openapi.rs; jobs must be claimable)
Prints one line per checked answer; exits non-zero at the first answer that breaks the document.
"""

import json
import sys
import urllib.error
import urllib.request

import jsonschema_rs

BASE, DOC_PATH = sys.argv[1], sys.argv[2]
with open(DOC_PATH, encoding="utf-8") as f:
    DOC = json.load(f)


def call(method, path, body=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(BASE + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def operation(template, method):
    op = DOC["paths"].get(template, {}).get(method.lower())
    assert op is not None, "%s %s is not in the document" % (method, template)
    return op


def check(template, method, path, body=None, raw=None, want=None, code=None):
    """Calls, and checks the answer against the document; returns the parsed body."""
    status, ctype, data = call(method, path, body, raw)
    op = operation(template, method)
    response = op["responses"].get(str(status))
    assert response is not None, "%s %s answered %s, which the document does not list: %r" % (method, path, status, data[:300])
    parsed = None
    content = response.get("content")
    if content is None:
        assert data == b"", "%s %s: %s has no documented body, got %r" % (method, path, status, data[:300])
    else:
        media = ctype.split(";")[0].strip()
        assert media in content, "%s %s: %s with Content-Type %r, documented %s" % (method, path, status, ctype, list(content))
        if media == "application/json":
            parsed = json.loads(data)
            schema = dict(content[media]["schema"])
            schema["components"] = DOC["components"]
            jsonschema_rs.Draft202012Validator(schema, validate_formats=True).validate(parsed)
    if want is not None:
        assert status == want, "%s %s: want %s, got %s %r" % (method, path, want, status, data[:300])
    if code is not None:
        assert parsed is not None and parsed.get("error") == code, "%s %s: want error %s, got %r" % (method, path, code, parsed)
    print("ok  %s %s -> %s%s" % (method, path, status, " " + parsed["error"] if isinstance(parsed, dict) and "error" in parsed else ""))
    return parsed


HB, COMPLETE, FAIL, RELEASE = ("/v1/jobs/{name}/" + v for v in ("heartbeat", "complete", "fail", "release"))

# The document the sidecar serves is the one in docs/.
served = check("/openapi.json", "GET", "/openapi.json", want=200)
assert served == DOC, "GET /openapi.json differs from %s" % DOC_PATH
check("/readyz", "GET", "/readyz", want=200)
check("/healthz", "GET", "/healthz", want=200)
check("/metrics", "GET", "/metrics", want=200)

# Success paths with real tokens.
claim = check("/v1/claim", "POST", "/v1/claim?wait=10", want=200)
name, token = claim["name"], claim["token"]
job = "/v1/jobs/%s/" % name
check(HB, "POST", job + "heartbeat", {"token": token}, want=200)
check(HB, "POST", job + "heartbeat", {"token": token, "checkpoint": {"o": 1}, "progress": 0.5, "message": "half"}, want=200)
check(HB, "POST", job + "heartbeat", {"token": token, "progress": None, "message": None}, want=200)
# Documented refusals of a held job: none of them writes anything.
check(HB, "POST", job + "heartbeat", {"token": token, "progress": 1.01}, want=400, code="invalid_request")
check(HB, "POST", job + "heartbeat", {"token": token, "message": "é" * 129}, want=400, code="invalid_request")
check(HB, "POST", job + "heartbeat", {"token": token, "message": "a\u0085b"}, want=400, code="invalid_request")
check(HB, "POST", job + "heartbeat", {"token": token, "extra": 1}, want=400, code="invalid_json")
check(HB, "POST", job + "heartbeat", {}, want=400, code="invalid_token")
check(HB, "POST", job + "heartbeat", {"token": token, "checkpoint": "x" * 70000}, want=413, code="too_large")
# (A body over 1 MiB is answered 413 before it is read, and the connection closed under the
# sender: tests/http_edge.rs checks that with a client that reads the answer.)
check(COMPLETE, "POST", job + "complete", {"token": token, "result": {"words": 3}}, want=200)
check(HB, "POST", job + "heartbeat", {"token": token}, want=409, code="job_finished")
check(COMPLETE, "POST", job + "complete", {"token": token, "result": 1}, want=409, code="job_finished")

claim = check("/v1/claim", "POST", "/v1/claim?wait=10", want=200)
job = "/v1/jobs/%s/" % claim["name"]
check(FAIL, "POST", job + "fail", {"token": claim["token"], "reason": "Bad Reason", "retryable": True}, want=400, code="invalid_request")
ended = check(FAIL, "POST", job + "fail", {"token": claim["token"], "reason": "Boom", "message": "m", "retryable": True}, want=200)
assert ended["phase"] == "Queued", ended
check(RELEASE, "POST", job + "release", {"token": claim["token"]}, want=409, code="lease_lost")

claim = check("/v1/claim", "POST", "/v1/claim?wait=10", want=200)
job = "/v1/jobs/%s/" % claim["name"]
ended = check(RELEASE, "POST", job + "release", {"token": claim["token"]}, want=200)
assert ended["phase"] == "Queued", ended

# Names, tokens and queries that are wrong.
check(HB, "POST", "/v1/jobs/no-such-job/heartbeat", {"token": token}, want=404, code="job_not_found")
check(HB, "POST", "/v1/jobs/Bad_Name/heartbeat", {"token": token}, want=400, code="invalid_name")
check(HB, "POST", "/v1/jobs/%ff%fe/heartbeat", {"token": token}, want=400, code="invalid_name")
check(HB, "POST", job + "heartbeat", {"token": "1.zz"}, want=400, code="invalid_token")
check("/v1/claim", "POST", "/v1/claim?wait=301", want=400, code="invalid_request")
check("/v1/claim", "POST", "/v1/claim?other=1", want=400, code="invalid_request")
print("every answer matched the document")
