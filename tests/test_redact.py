"""Secrets out of production text: each kind is replaced and counted, the secret never kept; ordinary text
(numbers, math, short values) is left alone."""

import pytest

from clgrpo.refresh.redact import Redactor, redact

SECRETS = [
    ("api_key", "use sk-proj-Abcdefghijklmnop1234567 for it", "sk-proj-Abcdefghijklmnop1234567"),
    ("api_key", "key sk-ant-api03-AAAABBBBCCCCDDDD1111", "sk-ant-api03-AAAABBBBCCCCDDDD1111"),
    ("aws_key", "AKIAIOSFODNN7EXAMPLE is mine", "AKIAIOSFODNN7EXAMPLE"),
    ("github_token", "ghp_0123456789abcdefghijABCDEFGHIJ012345", "ghp_0123456789abcdefghijABCDEFGHIJ012345"),
    ("bearer_token", "Authorization: Bearer eyXz.abcdefghijklmnop-qrs", "eyXz.abcdefghijklmnop-qrs"),
    ("url_password", "postgres://admin:hunter2@db.internal:5432/app", "hunter2"),
    ("credential", "GET /v1?api_key=9f86d081884c7d659a2feaa0c55ad015", "9f86d081884c7d659a2feaa0c55ad015"),
    ("credential", '{"secret": "ZXhhbXBsZTEyMzQ1Njc4OTA="}', "ZXhhbXBsZTEyMzQ1Njc4OTA="),
    ("private_key", "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow"),
    ("jwt", "token eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.SflKxwRJSMeKKF2QT4", "eyJzdWIiOiIxMjM0"),
]


@pytest.mark.parametrize(("kind", "text", "secret"), SECRETS)
def test_each_kind_of_secret_is_replaced_and_counted(kind, text, secret):
    redactor = Redactor()
    out = redactor(text)
    assert secret not in out and f"[REDACTED:{kind}]" in out
    assert redactor.counts[kind] == 1 and redactor.total == 1
    assert secret not in redactor.summary() and kind in redactor.summary()


def test_ordinary_text_is_left_alone():
    text = (
        "Compute 123456789012345678 * 2. The key = 42, token: short, sha 9f86d081 in prose; "
        "see https://example.com/a/b and mail me at x@example.com"
    )
    redactor = Redactor()
    assert redactor(text) == text and redactor.total == 0
    assert redactor.summary() == "no secrets redacted"


def test_emails_only_when_asked():
    assert redact("write to alice@example.com") == "write to alice@example.com"
    assert Redactor(emails=True)("write to alice@example.com") == "write to [REDACTED:email]"


def test_the_prefix_is_kept_and_counts_add_up():
    redactor = Redactor()
    out = redactor("user:pw in https://bob:s3cret@host/x and Bearer abcdefghijklmnop1234 and Bearer qrstuvwxyz567890ab")
    assert out == (
        "user:pw in https://bob:[REDACTED:url_password]@host/x and Bearer [REDACTED:bearer_token] and "
        "Bearer [REDACTED:bearer_token]"
    )
    assert redactor.total == 3
