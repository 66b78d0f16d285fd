"""The fake sidecar answers as the real one does (docs/protocol.md, "The sidecar's HTTP
API"; the cluster suite in ../tests holds the real one to the same answers): routes,
bodies, status codes, error codes, validation and fencing."""

import http.client
import json
import re
import threading
import time

import pytest

import leasehold
from leasehold import testing

TOKEN = re.compile(r"[1-9][0-9]*\.[0-9a-f]{32}\Z")
OTHER = "1." + "ab" * 16  # well-formed, nobody's


def post(fake, path, body=None, raw=None, method="POST", headers=None):
    """(status, JSON answer or None) of one request."""
    port = int(fake.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=dict({"Content-Length": str(len(data))}, **(headers or {})))
    response = conn.getresponse()
    text = response.read()
    conn.close()
    return response.status, (json.loads(text) if text else None)


def claimed(fake, name="j", **kwargs):
    fake.add_job(name, {"n": 1}, **kwargs)
    status, answer = post(fake, "/v1/claim?wait=0")
    assert status == 200, answer
    return answer


def refused(answer, status, code):
    got_status, body = answer
    assert (got_status, body.get("error")) == (status, code), body
    assert isinstance(body["message"], str) and body["message"]
    return body["message"]


# ---- claim


def test_a_claim_answers_the_documented_shape(fake):
    answer = claimed(fake, "j", checkpoint={"at": 3}, max_attempts=4, failures=["Timeout"], lease_duration=7)
    fields = "namespace name queue attempt token payload leaseDurationSeconds checkpoint maxAttempts failures lastAttempt"
    assert set(answer) == set(fields.split())
    assert (answer["namespace"], answer["name"], answer["attempt"], answer["payload"]) == ("default", "j", 2, {"n": 1})
    assert answer["queue"] == "jobs"
    assert TOKEN.match(answer["token"]) and answer["token"].startswith("2.")
    assert (answer["leaseDurationSeconds"], answer["checkpoint"], answer["maxAttempts"]) == (7, {"at": 3}, 4)
    assert [f["reason"] for f in answer["failures"]] == ["Timeout"] and answer["lastAttempt"] is False


def test_a_claim_carries_a_valid_traceparent_only(fake):
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    answer = claimed(fake, "a", traceparent=traceparent, tracestate="rojo=1")
    assert (answer["traceparent"], answer["tracestate"]) == (traceparent, "rojo=1")
    # Malformed (uppercase hex), as the sidecar does: the claim carries neither field.
    answer = claimed(fake, "b", traceparent=traceparent.upper(), tracestate="rojo=1")
    assert "traceparent" not in answer and "tracestate" not in answer


def test_a_claim_with_nothing_claimable_answers_204(fake):
    assert post(fake, "/v1/claim?wait=0") == (204, None)
    assert post(fake, "/v1/claim") == (204, None)


def test_a_claim_long_polls_until_a_job_is_added(fake):
    threading.Timer(0.3, lambda: fake.add_job("late")).start()
    started = time.monotonic()
    status, answer = post(fake, "/v1/claim?wait=5")
    assert (status, answer["name"]) == (200, "late")
    assert 0.2 < time.monotonic() - started < 2


@pytest.mark.parametrize("query", ["wait=301", "wait=-1", "wait=abc", "wait=1.5", "wait=", "wait=1&x=2", "x=1"])
def test_a_bad_wait_is_an_invalid_request(fake, query):
    refused(post(fake, "/v1/claim?" + query), 400, "invalid_request")


def test_a_shutting_down_sidecar_claims_nothing_but_held_jobs_still_work(fake):
    answer = claimed(fake)
    fake.add_job("waiting")
    fake.shut_down()
    refused(post(fake, "/v1/claim?wait=0"), 503, "shutting_down")
    assert post(fake, "/readyz", method="GET")[0] == 503
    assert post(fake, "/healthz", method="GET")[0] == 200
    assert post(fake, "/v1/jobs/j/heartbeat", {"token": answer["token"]})[0] == 200
    assert post(fake, "/v1/jobs/j/complete", {"token": answer["token"], "result": 1})[0] == 200


def test_a_claim_waiting_when_the_sidecar_starts_shutting_down_is_answered_so(fake):
    threading.Timer(0.2, fake.shut_down).start()
    refused(post(fake, "/v1/claim?wait=5"), 503, "shutting_down")


def test_the_client_raises_the_typed_exception_of_each_code(fake):
    client = fake.client()
    fake.shut_down()
    with pytest.raises(leasehold.ShuttingDown):
        client.claim(0)


# ---- bodies


@pytest.mark.parametrize("route", ["heartbeat", "complete", "fail", "release"])
@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1]", b'"text"', b'{"token": 5}', b'{"token": "t", "bogus": 1}', b'{"token": "a", "token": "b"}'],
)
def test_a_body_that_is_not_the_expected_json_is_invalid_json(fake, route, raw):
    claimed(fake)
    refused(post(fake, "/v1/jobs/j/%s" % route, raw=raw), 400, "invalid_json")


def test_nan_is_not_json(fake):
    answer = claimed(fake)
    raw = ('{"token": "%s", "checkpoint": NaN}' % answer["token"]).encode()
    refused(post(fake, "/v1/jobs/j/heartbeat", raw=raw), 400, "invalid_json")


def test_fields_of_the_wrong_type_are_invalid_json(fake):
    answer = claimed(fake)
    token = answer["token"]
    refused(post(fake, "/v1/jobs/j/fail", {"token": token, "reason": "X", "retryable": "yes"}), 400, "invalid_json")
    refused(post(fake, "/v1/jobs/j/fail", {"token": token, "reason": 7, "retryable": True}), 400, "invalid_json")
    refused(post(fake, "/v1/jobs/j/fail", {"token": token, "reason": "X", "message": 1, "retryable": True}), 400, "invalid_json")


@pytest.mark.parametrize("route", ["heartbeat", "complete", "fail", "release"])
@pytest.mark.parametrize("token", [None, "", "abc", "0." + "a" * 32, "1." + "A" * 32, "1." + "a" * 31, "01." + "a" * 32])
def test_a_missing_or_malformed_token_is_an_invalid_token(fake, route, token):
    claimed(fake)
    body = {"token": token, "result": None} if route == "complete" else {"token": token}
    if route == "fail":
        body.update(reason="Broken", retryable=False)
    if token is None:
        del body["token"]
    says = refused(post(fake, "/v1/jobs/j/%s" % route, body), 400, "invalid_token")
    assert ("missing" if not token else "malformed") in says


def test_the_client_raises_invalid_token(fake):
    claimed(fake)
    with pytest.raises(leasehold.InvalidToken):
        fake.client().heartbeat("j", "nope")


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"reason": ""}, "reason"),
        ({"reason": "9Lives"}, "reason"),
        ({"reason": "Not-Camel"}, "reason"),
        ({"reason": "A" * 65}, "reason"),
        ({"reason": "Ünicode"}, "reason"),
        ({"message": "é" * 2049}, "4098 bytes"),
        ({"retryAfterSeconds": 5, "retryable": False}, "not retryable"),
        ({"retryAfterSeconds": 86401}, "retryAfterSeconds"),
        ({"retryAfterSeconds": -1}, "retryAfterSeconds"),
        ({"retryAfterSeconds": 1.5}, "retryAfterSeconds"),
        ({"retryAfterSeconds": "5"}, "retryAfterSeconds"),
        ({"reason": None}, "reason is missing"),
        ({"retryable": None}, "retryable is missing"),
    ],
)
def test_a_failure_breaking_a_rule_is_an_invalid_request_and_changes_nothing(fake, extra, says):
    answer = claimed(fake)
    body = dict({"token": answer["token"], "reason": "Broken", "retryable": True}, **extra)
    body = {k: v for k, v in body.items() if v is not None}
    assert says in refused(post(fake, "/v1/jobs/j/fail", body), 400, "invalid_request")
    assert fake.job("j").phase == "Leased"


def test_a_failure_at_the_limits_is_accepted(fake):
    answer = claimed(fake)
    body = {"token": answer["token"], "reason": "A" * 64, "message": "é" * 2048, "retryable": True, "retryAfterSeconds": 0}
    status, ended = post(fake, "/v1/jobs/j/fail", body)
    assert (status, ended["phase"]) == (200, "Queued") and "retryAfter" not in ended


def test_retry_after_is_capped_at_the_backoff_max_and_delays_the_next_claim(fake):
    answer = claimed(fake, backoff_max_seconds=2)
    body = {"token": answer["token"], "reason": "RateLimited", "retryable": True, "retryAfterSeconds": 600}
    status, ended = post(fake, "/v1/jobs/j/fail", body)
    assert (status, set(ended)) == (200, {"namespace", "name", "attempt", "phase", "retryAfter"})
    assert ended["phase"] == "Queued"
    assert fake.outcome("j").retry_after_seconds == 600  # as sent
    assert post(fake, "/v1/claim?wait=0") == (204, None)  # not before retryAfter (<= 3 s away)
    status, again = post(fake, "/v1/claim?wait=5")
    assert (status, again["attempt"]) == (200, 2)


def test_a_retryable_failure_of_the_last_attempt_ends_the_job(fake):
    answer = claimed(fake, max_attempts=2, failures=["Timeout"])
    assert answer["lastAttempt"] is True
    body = {"token": answer["token"], "reason": "Timeout", "retryable": True}
    assert post(fake, "/v1/jobs/j/fail", body)[1]["phase"] == "Failed"


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"progress": 1.5}, "out of range"),
        ({"progress": -0.5}, "out of range"),
        ({"progress": "0.5"}, "not a number"),
        ({"progress": True}, "not a number"),
        ({"message": "two\nlines"}, "control character"),
        ({"message": "x" * 257}, "257 bytes"),
        ({"message": ["list"]}, "not a string"),
    ],
)
def test_progress_breaking_a_rule_is_an_invalid_request_and_renews_nothing(fake, extra, says):
    answer = claimed(fake)
    body = dict({"token": answer["token"]}, **extra)
    assert says in refused(post(fake, "/v1/jobs/j/heartbeat", body), 400, "invalid_request")
    assert fake.outcome("j").heartbeats == 0


def test_a_heartbeat_answers_the_documented_shape_and_records_what_it_carried(fake):
    answer = claimed(fake, lease_duration=9)
    body = {"token": answer["token"], "checkpoint": {"at": 1}, "progress": 1, "message": "x" * 256}
    status, renewal = post(fake, "/v1/jobs/j/heartbeat", body)
    assert (status, set(renewal)) == (200, {"renewTime", "expiresAt", "leaseDurationSeconds"})
    assert renewal["leaseDurationSeconds"] == 9
    assert post(fake, "/v1/jobs/j/heartbeat", {"token": answer["token"], "checkpoint": None})[0] == 200
    outcome = fake.outcome("j")
    assert (outcome.heartbeats, outcome.checkpoints, outcome.progress) == (2, [{"at": 1}], [(1.0, "x" * 256)])


def test_a_checkpoint_over_64_kib_is_too_large_and_not_stored(fake):
    answer = claimed(fake)
    body = {"token": answer["token"], "checkpoint": "x" * (64 * 1024)}  # 2 bytes of quotes over
    refused(post(fake, "/v1/jobs/j/heartbeat", body), 413, "too_large")
    assert fake.outcome("j").checkpoints == []


def test_a_body_over_1_mib_is_too_large(fake):
    answer = claimed(fake)
    raw = json.dumps({"token": answer["token"], "result": "x" * (1024 * 1024)}).encode()
    refused(post(fake, "/v1/jobs/j/complete", raw=raw), 413, "too_large")


def test_a_result_that_would_make_the_job_too_large_is_refused_and_the_job_still_held(fake):
    fake.add_job("j", {"blob": "x" * (600 * 1024)})
    token = post(fake, "/v1/claim")[1]["token"]
    refused(post(fake, "/v1/jobs/j/complete", {"token": token, "result": "y" * (600 * 1024)}), 413, "too_large")
    assert post(fake, "/v1/jobs/j/complete", {"token": token, "result": "small"})[0] == 200


def test_complete_needs_a_result_but_null_is_one(fake):
    answer = claimed(fake)
    assert "result is missing" in refused(post(fake, "/v1/jobs/j/complete", {"token": answer["token"]}), 400, "invalid_request")
    status, ended = post(fake, "/v1/jobs/j/complete", {"token": answer["token"], "result": None})
    assert (status, ended) == (200, {"namespace": "default", "name": "j", "attempt": 1, "phase": "Succeeded"})


# ---- routes and names


def test_unknown_routes_and_methods_are_refused_in_json(fake):
    refused(post(fake, "/v2/claim"), 404, "not_found")
    refused(post(fake, "/v1/jobs/j/explode", {}), 404, "not_found")
    refused(post(fake, "/v1/claim", method="GET"), 405, "method_not_allowed")
    refused(post(fake, "/v1/jobs/j/heartbeat", method="GET"), 405, "method_not_allowed")


@pytest.mark.parametrize("name", ["Upper", "a_b", "-a", "a-", "%ff%fe", "a" * 254])
def test_a_job_name_that_is_not_an_object_name_is_an_invalid_name(fake, name):
    refused(post(fake, "/v1/jobs/%s/heartbeat" % name, {"token": OTHER}), 400, "invalid_name")


def test_an_unknown_job_is_job_not_found(fake):
    refused(post(fake, "/v1/jobs/nobody/heartbeat", {"token": OTHER}), 404, "job_not_found")
    with pytest.raises(leasehold.JobNotFound):
        fake.client().complete("nobody", OTHER, 1)


# ---- fencing


def test_another_token_is_lease_lost(fake):
    claimed(fake)
    says = refused(post(fake, "/v1/jobs/j/heartbeat", {"token": OTHER}), 409, "lease_lost")
    assert "not the token of that attempt" in says and OTHER not in says


def test_the_token_of_an_earlier_attempt_is_lease_lost_naming_the_current_attempt(fake):
    first = claimed(fake)
    assert post(fake, "/v1/jobs/j/release", {"token": first["token"]})[1]["phase"] == "Queued"
    second = post(fake, "/v1/claim")[1]
    assert second["attempt"] == 2
    says = refused(post(fake, "/v1/jobs/j/complete", {"token": first["token"], "result": 1}), 409, "lease_lost")
    assert "is on attempt 2, your token is from attempt 1" in says and second["token"] not in says


def test_an_ended_attempt_is_fenced(fake):
    answer = claimed(fake)
    token = answer["token"]
    post(fake, "/v1/jobs/j/release", {"token": token})
    says = refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 409, "lease_lost")
    assert "attempt 1 ended" in says


def test_a_finished_job_is_job_finished_and_a_repeated_ending_is_answered_as_the_first(fake):
    token = claimed(fake)["token"]
    first = post(fake, "/v1/jobs/j/complete", {"token": token, "result": {"ok": 1}})
    assert post(fake, "/v1/jobs/j/complete", {"token": token, "result": {"ok": 1}}) == first  # a retry
    refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 409, "job_finished")
    refused(post(fake, "/v1/jobs/j/release", {"token": token}), 409, "job_finished")
    assert fake.job("j").result == {"ok": 1}


def test_a_cancelled_job_is_cancelled(fake):
    token = claimed(fake)["token"]
    fake.cancel("j")
    refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 409, "cancelled")
    with pytest.raises(leasehold.Cancelled):
        fake.client().complete("j", token, 1)
    assert (fake.job("j").phase, fake.outcome("j").status) == ("Cancelled", "cancelled")


def test_a_queued_job_cancelled_is_never_claimed(fake):
    fake.add_job("j")
    fake.cancel("j")
    assert post(fake, "/v1/claim") == (204, None)


def test_a_lost_lease_requeues_the_job_with_its_checkpoint_and_counts_as_a_failure(fake):
    token = claimed(fake, max_attempts=3)["token"]
    post(fake, "/v1/jobs/j/heartbeat", {"token": token, "checkpoint": 41})
    fake.lose_lease("j")
    refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 409, "lease_lost")
    again = post(fake, "/v1/claim")[1]
    assert (again["attempt"], again["checkpoint"]) == (2, 41)
    assert [f["reason"] for f in again["failures"]] == ["LeaseExpired"]


def test_a_lost_lease_on_the_last_attempt_fails_the_job(fake):
    token = claimed(fake, max_attempts=1)["token"]
    fake.lose_lease("j")
    refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 409, "job_finished")
    assert fake.job("j").phase == "Failed"


def test_losing_the_lease_of_a_job_not_running_needs_a_condition(fake):
    fake.add_job("j")
    with pytest.raises(ValueError):
        fake.lose_lease("j")


def test_with_expire_leases_a_lease_not_renewed_for_its_duration_expires():
    with testing.FakeSidecar(expire_leases=True) as fake:
        token = claimed(fake, lease_duration=0.4)["token"]
        assert post(fake, "/v1/jobs/j/heartbeat", {"token": token})[0] == 200
        time.sleep(0.5)
        refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 409, "lease_lost")
        assert fake.outcome("j").status == "lost"
        assert post(fake, "/v1/claim")[1]["attempt"] == 2


# ---- outages and delays


def test_an_outage_answers_unavailable_with_expires_at_and_applies_nothing(fake):
    token = claimed(fake)["token"]
    fake.unavailable("complete", times=1)
    status, body = post(fake, "/v1/jobs/j/complete", {"token": token, "result": 1})
    assert (status, body["error"]) == (503, "unavailable") and body["expiresAt"].endswith("Z")
    assert fake.job("j").phase == "Leased"
    assert post(fake, "/v1/jobs/j/complete", {"token": token, "result": 1})[0] == 200


def test_an_outage_of_claims_ends_after_its_seconds(fake):
    fake.add_job("j")
    fake.unavailable("claim", seconds=0.3)
    refused(post(fake, "/v1/claim"), 503, "unavailable")
    time.sleep(0.35)
    assert post(fake, "/v1/claim")[0] == 200


def test_an_outage_ends_on_request(fake):
    token = claimed(fake)["token"]
    fake.unavailable()
    refused(post(fake, "/v1/jobs/j/heartbeat", {"token": token}), 503, "unavailable")
    fake.available()
    assert post(fake, "/v1/jobs/j/heartbeat", {"token": token})[0] == 200


def test_a_delay_holds_the_answer(fake):
    token = claimed(fake)["token"]
    fake.delay(0.3, "heartbeat")
    started = time.monotonic()
    assert post(fake, "/v1/jobs/j/heartbeat", {"token": token})[0] == 200
    assert time.monotonic() - started >= 0.3
    fake.delay(0)
    started = time.monotonic()
    post(fake, "/v1/jobs/j/heartbeat", {"token": token})
    assert time.monotonic() - started < 0.3


def test_unknown_routes_cannot_be_slowed(fake):
    with pytest.raises(ValueError):
        fake.delay(1, "claims")
    with pytest.raises(ValueError):
        fake.unavailable("beat")


def test_every_request_is_recorded(fake):
    token = claimed(fake)["token"]
    post(fake, "/v1/jobs/j/heartbeat", {"token": "bad"})
    post(fake, "/v1/jobs/j/complete", {"token": token, "result": 2})
    assert [(r.route, r.name, r.status, r.error) for r in fake.requests] == [
        ("claim", None, 200, None),
        ("heartbeat", "j", 400, "invalid_token"),
        ("complete", "j", 200, None),
    ]
    assert fake.requests[2].body == {"token": token, "result": 2}
