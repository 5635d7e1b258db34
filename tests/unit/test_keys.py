"""Unit tests for the pure parts of API keys: splitting a token, hashing and checking secrets,
what a key sees and whether it manages its tenant."""

import hashlib
import secrets

import pytest

from broker.tenancy.keys import PREFIX, Principal, hash_secret, secret_matches, split_token

# --- split_token ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "parts"),
    [
        ("rk_abc123_s3cr3t", ("abc123", "s3cr3t")),
        ("rk_abc_se_cr_et", ("abc", "se_cr_et")),  # the secret keeps its own underscores
        ("rk_abc_-x-", ("abc", "-x-")),
        ("rk_" + "k" * 32 + "_secret", ("k" * 32, "secret")),  # key_id of 32: the limit
    ],
)
def test_given_a_token_of_the_rk_form_expect_key_id_and_secret(
    token: str, parts: tuple[str, str]
) -> None:
    assert split_token(token) == parts


@pytest.mark.parametrize(
    "token",
    [
        "",
        "abc_secret",
        "rk_",
        "rk_abc",
        "rk_abc_",
        "rk__secret",
        "RK_abc_secret",
        "rk-abc-secret",
        "Bearer rk_abc_secret",
        "rk_" + "k" * 33 + "_secret",  # key_id over 32
    ],
)
def test_given_a_token_not_of_the_rk_form_expect_none(token: str) -> None:
    assert split_token(token) is None


def test_given_tokens_made_like_create_key_expect_them_split_back_exactly() -> None:
    for _ in range(200):
        key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        assert split_token(f"{PREFIX}{key_id}_{secret}") == (key_id, secret)


# --- hash_secret and secret_matches --------------------------------------------------------


def test_given_a_secret_expect_its_hash_is_sha256_hex_of_its_utf8() -> None:
    assert hash_secret("s3cr3t") == hashlib.sha256(b"s3cr3t").hexdigest()
    assert hash_secret("pässwörd") == hashlib.sha256("pässwörd".encode()).hexdigest()


def test_given_a_secret_hashed_twice_expect_the_same_hash_and_no_trace_of_the_secret() -> None:
    secret = secrets.token_urlsafe(32)
    assert hash_secret(secret) == hash_secret(secret)
    assert len(hash_secret(secret)) == 64
    assert secret not in hash_secret(secret)


def test_given_different_secrets_expect_different_hashes() -> None:
    assert hash_secret("a") != hash_secret("b")
    assert hash_secret("secret") != hash_secret("secret ")


def test_given_the_right_secret_expect_it_matches_its_stored_hash() -> None:
    secret = secrets.token_urlsafe(32)
    assert secret_matches(secret, hash_secret(secret))


@pytest.mark.parametrize(
    ("secret", "stored_for"),
    [("wrong", "right"), ("Right", "right"), ("right ", "right"), ("", "right")],
)
def test_given_a_wrong_secret_expect_no_match(secret: str, stored_for: str) -> None:
    assert not secret_matches(secret, hash_secret(stored_for))


@pytest.mark.parametrize("stored", ["", "0" * 64, "not-a-hash"])
def test_given_a_stored_hash_that_is_not_the_secrets_expect_no_match(stored: str) -> None:
    assert not secret_matches("right", stored)


# --- Principal: what a key sees and manages ------------------------------------------------


def principal(**flags: bool) -> Principal:
    return Principal(key_id="k", tenant="t", capabilities=("echo",), **flags)


def test_given_a_plain_key_expect_it_to_see_its_patterns_and_manage_nothing() -> None:
    plain = principal()
    assert plain.sees == ("echo",)
    assert plain.may_see("echo") and not plain.may_see("invoice.extract")
    assert not plain.manages_tenant


@pytest.mark.parametrize("flag", ["tenant_admin", "is_admin"])
def test_given_a_tenant_admin_or_operator_key_expect_it_to_see_and_manage_the_tenant(
    flag: str,
) -> None:
    manager = principal(**{flag: True})
    assert manager.manages_tenant
    assert manager.sees == ("*",)
    assert manager.may_see("invoice.extract")
