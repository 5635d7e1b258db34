"""Our Standard Webhooks signatures, checked by the reference verifier from PyPI
(``standardwebhooks``), which nobody here wrote."""

from __future__ import annotations

import base64
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from broker.webhooks.signing import PREFIX, headers, new_secret, secret_key, sign

BODY = b'{"type":"task.succeeded","data":{"task_id":"t1","note":"caf\xc3\xa9"}}'


def signed(*valid: str, body: bytes = BODY) -> dict[str, str]:
    return headers(valid, "msg_abc", int(time.time()), body)


def test_a_new_secret_is_whsec_and_base64_of_24_to_64_random_bytes() -> None:
    for size in (24, 32, 64):
        secret = new_secret(size)
        assert secret.startswith(PREFIX)
        assert len(base64.b64decode(secret[len(PREFIX) :], validate=True)) == size
    assert new_secret() != new_secret()
    with pytest.raises(ValueError):
        new_secret(16)


def test_given_our_signature_expect_the_reference_verifier_accepts_it() -> None:
    secret = new_secret()
    assert Webhook(secret).verify(BODY, signed(secret))["data"]["task_id"] == "t1"


def test_given_a_tampered_body_expect_verification_fails() -> None:
    secret = new_secret()
    sent = signed(secret)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY.replace(b"t1", b"t2"), sent)


def test_given_another_secret_expect_verification_fails() -> None:
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(BODY, signed(new_secret()))


def test_given_a_changed_message_id_expect_verification_fails() -> None:
    secret = new_secret()
    sent = {**signed(secret), "webhook-id": "msg_other"}
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY, sent)


def test_during_rotation_both_secrets_sign_and_either_verifies() -> None:
    old, new = new_secret(), new_secret()
    sent = signed(new, old)
    assert len(sent["webhook-signature"].split(" ")) == 2
    assert Webhook(old).verify(BODY, sent)["type"] == "task.succeeded"
    assert Webhook(new).verify(BODY, sent)["type"] == "task.succeeded"


def test_the_signature_is_hmac_sha256_of_id_timestamp_body() -> None:
    import hashlib
    import hmac

    secret = new_secret()
    expected = hmac.new(secret_key(secret), b"msg_1.1700000000." + BODY, hashlib.sha256)
    assert (
        sign(secret, "msg_1", 1700000000, BODY)
        == "v1," + base64.b64encode(expected.digest()).decode()
    )


def test_given_one_secret_for_many_messages_expect_each_signed_alone() -> None:
    """The keyed HMAC kept for a secret is copied for each message, never written to."""
    import hashlib
    import hmac

    secret = new_secret()
    bodies = [BODY, b"{}", BODY]
    signatures = [sign(secret, "msg_1", 1700000000, body) for body in bodies]
    for body, signature in zip(bodies, signatures, strict=True):
        expected = hmac.new(secret_key(secret), b"msg_1.1700000000." + body, hashlib.sha256)
        assert signature == "v1," + base64.b64encode(expected.digest()).decode()
