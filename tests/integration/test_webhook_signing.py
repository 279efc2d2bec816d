"""Signed webhooks (Standard Webhooks): a real engine signs every delivery; the
``standardwebhooks`` package from PyPI, acting as the receiver, verifies them, and refuses
a wrong secret, a changed body and a replay past its timestamp tolerance. Retries keep
their ``webhook-id`` and carry the attempt's own timestamp and signature, so an event
delivered hours after it was first tried (the engine run under ``faketime``) verifies."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time

import orjson
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from spliceway import ApiError, Engine
from spliceway.connector.signing import Signer, secret_key
from tests.conftest import wait_until
from tests.helpers.receiver import Received, Receiver, Reply
from tests.helpers.servers import EchoServer
from tests.helpers.sinks import EngineProcess, sink_config, status_of, webhook
from tests.helpers.socks import socks5_connect

SECRET = "whsec_" + base64.b64encode(b"spliceway-test-secret-0123456789").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"somebody-else-s-secret-987654321").decode()
SECRET_ENV = "SW_TEST_WEBHOOK_SECRET"

FAKETIME = shutil.which("faketime")


def headers_of(request: Received) -> dict[str, str]:
    """The signature headers of one request (the library reads only these)."""
    return {k: v for k, v in request.headers.items() if k.startswith("webhook-")}


def test_every_delivery_verifies_and_names_its_event(make_engine, tmp_path, monkeypatch):
    """Each POST carries webhook-id = the body's event_id, the attempt's timestamp and a
    v1 signature the library accepts; a wrong secret and a changed body are refused."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with Receiver() as rx, EchoServer() as echo:
        cfg = sink_config(
            [webhook("signed", rx.url, events=["flow.completed"], secret_env=SECRET_ENV)]
        )
        engine = make_engine(cfg)
        sent_at = time.time()
        for _ in range(3):
            with socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port) as s:
                s.sendall(b"ping")
                assert s.recv(4) == b"ping"
        requests = rx.wait_for(3)
        received_at = time.time()
    receiver, intruder = Webhook(SECRET), Webhook(OTHER_SECRET)
    ids = set()
    for request in requests:
        headers = headers_of(request)
        assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
        envelope = receiver.verify(request.body, headers)
        assert envelope["event_type"] == "flow.completed"
        assert headers["webhook-id"] == envelope["event_id"]
        assert int(sent_at) <= int(headers["webhook-timestamp"]) <= received_at
        assert headers["webhook-signature"].startswith("v1,")
        with pytest.raises(WebhookVerificationError, match="No matching signature"):
            intruder.verify(request.body, headers)
        tampered = request.body.replace(b'"flow.completed"', b'"flow.completeD"')
        with pytest.raises(WebhookVerificationError, match="No matching signature"):
            receiver.verify(tampered, headers)
        ids.add(headers["webhook-id"])
    assert len(ids) == 3


def test_a_retry_keeps_its_id_and_signs_its_own_timestamp(make_engine, monkeypatch):
    """A refused attempt (503, Retry-After: 2) is retried two seconds later with the same
    webhook-id, a later timestamp and a new signature; both verify."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with Receiver() as rx:
        rx.script(Reply(503, headers={"Retry-After": "2"}))
        cfg = sink_config(
            [webhook("signed", rx.url, events=["engine.started"], secret_env=SECRET_ENV)],
            dispatcher={"backoff_max_ms": 5000},
        )
        make_engine(cfg)
        first, retry = rx.wait_for(2)
    receiver = Webhook(SECRET)
    for attempt in (first, retry):
        receiver.verify(attempt.body, headers_of(attempt))
    assert first.body == retry.body
    assert first.headers["webhook-id"] == retry.headers["webhook-id"]
    assert int(retry.headers["webhook-timestamp"]) >= int(first.headers["webhook-timestamp"]) + 2
    assert first.headers["webhook-signature"] != retry.headers["webhook-signature"]


@pytest.mark.skipif(
    FAKETIME is None and not os.environ.get("CI"),
    reason="needs faketime (apt-get install faketime)",
)
def test_delivered_hours_later_it_verifies_and_the_old_attempt_does_not(tmp_path):
    """An engine fails to deliver (503) and stops with the event in its outbox; three hours
    later (the next engine and the receiver's clock run under faketime +3h) the event is
    delivered with the same webhook-id and verifies, while the first attempt's request,
    replayed then, is refused as too old."""
    outbox = tmp_path / "outbox"
    env = {SECRET_ENV: SECRET}

    def config(url: str) -> dict:
        return sink_config(
            [webhook("signed", url, events=["engine.started"], secret_env=SECRET_ENV)],
            outbox,
            control=True,
        )

    with Receiver() as rx:
        rx.default = Reply(503)
        first = EngineProcess(config(rx.url), tmp_path, "now", env=env)
        try:
            first.wait_started()
            early = rx.wait_for(1)[0]
            assert first.stop() == 0
        finally:
            first.close()
        rx.default = Reply(200)
        later = EngineProcess(
            config(rx.url), tmp_path, "later", prefix=[FAKETIME or "faketime", "-f", "+3h"], env=env
        )
        try:
            later.wait_started()
            early_id = early.headers["webhook-id"]

            def delivered_again() -> list[Received]:
                return [
                    r
                    for r in rx.requests
                    if r.headers["webhook-id"] == early_id
                    and int(r.headers["webhook-timestamp"]) > time.time() + 3600
                ]

            deadline = time.monotonic() + 20
            while not delivered_again() and time.monotonic() < deadline:
                rx.wait_for(len(rx.requests) + 1, timeout=deadline - time.monotonic())
            late = delivered_again()[0]
            assert status_of(later.get("sinks"), "signed")["pending"] == 0
        finally:
            try:
                later.stop()
            finally:
                later.close()
        # faketime forks the engine: the engine itself must not outlive the test.
        wait_until(
            lambda: not _running_with(str(later.config_path)), 10, "the engine under faketime gone"
        )
    assert late.body == early.body
    assert (
        int(late.headers["webhook-timestamp"]) - int(early.headers["webhook-timestamp"]) >= 3 * 3600
    )
    verdicts = verify_under_faketime(
        "+3h", [(late.body, headers_of(late)), (early.body, headers_of(early))]
    )
    assert verdicts == ["ok", "Message timestamp too old"]


def _running_with(argument: str) -> list[int]:
    """The pids of live processes with ``argument`` on their command line."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if argument.encode() in args and not zombie:
            found.append(int(entry))
    return found


def verify_under_faketime(offset: str, deliveries: list[tuple[bytes, dict[str, str]]]) -> list[str]:
    """The library's verdict on each delivery, from a receiver process whose clock is
    shifted by ``offset`` (faketime)."""
    script = (
        "import json, sys\n"
        "from standardwebhooks.webhooks import Webhook, WebhookVerificationError\n"
        f"hook = Webhook({SECRET!r})\n"
        "out = []\n"
        "for body, headers in json.load(sys.stdin):\n"
        "    try:\n"
        "        hook.verify(body.encode(), headers)\n"
        "        out.append('ok')\n"
        "    except WebhookVerificationError as ex:\n"
        "        out.append(str(ex))\n"
        "print(json.dumps(out))\n"
    )
    doc = json.dumps([(body.decode(), headers) for body, headers in deliveries])
    done = subprocess.run(
        [FAKETIME or "faketime", "-f", offset, sys.executable, "-c", script],
        input=doc,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(done.stdout)


def test_an_unset_or_malformed_secret_is_a_start_error(monkeypatch):
    """The engine refuses to start without the secret, naming the variable and its field,
    as for api_key_env; a value that is no whsec_ secret is refused the same way."""
    cfg = sink_config([webhook("signed", "http://127.0.0.1:9/", secret_env=SECRET_ENV)])
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ApiError) as unset:
        Engine(cfg).start()
    assert unset.value.code == "invalid_argument"
    assert SECRET_ENV in unset.value.message
    assert unset.value.field_path == "api.event_sinks[0].secret_env"
    for bad, why in (("s3cret", "must start with whsec_"), ("whsec_!!", "followed by base64")):
        monkeypatch.setenv(SECRET_ENV, bad)
        with pytest.raises(ApiError) as malformed:
            Engine(cfg).start()
        assert why in malformed.value.message
        assert malformed.value.field_path == "api.event_sinks[0].secret_env"


def test_a_configured_signature_header_is_refused():
    """A sink that signs may not also configure the headers the signature sets."""
    cfg = sink_config(
        [
            webhook(
                "signed",
                "http://127.0.0.1:9/",
                secret_env=SECRET_ENV,
                headers={"Webhook-Signature": "v1,forged"},
            )
        ]
    )
    with pytest.raises(ApiError) as refused:
        Engine(cfg)
    assert refused.value.details[0].field_path == "api.event_sinks[0]"
    assert "Webhook-Signature" in refused.value.details[0].message


def test_the_signer_matches_the_library_byte_for_byte():
    """The engine's signature for fixed inputs equals the library's own ``sign``."""
    from datetime import UTC, datetime

    body = orjson.dumps({"event_id": "e-1", "payload": {"x": "ü"}})
    ours = Signer(secret_key(SECRET)).signature("e-1", 1700000000, body)
    theirs = Webhook(SECRET).sign("e-1", datetime.fromtimestamp(1700000000, tz=UTC), body.decode())
    assert ours == theirs
