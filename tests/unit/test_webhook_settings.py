"""Webhook settings from the environment: comma lists like REACH_AGENTS."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from broker.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REACH_WEBHOOK_ALLOW", "REACH_WEBHOOK_SCHEDULE_S"):
        monkeypatch.delenv(name, raising=False)


def test_the_production_default_allows_nothing_and_retries_for_about_a_day() -> None:
    settings = Settings()
    assert settings.webhook_allow == []
    assert settings.webhook_schedule_s[0] == 0
    assert 20 * 3600 < sum(settings.webhook_schedule_s) < 36 * 3600
    assert settings.webhook_timeout_s == 15


def test_comma_lists_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_WEBHOOK_ALLOW", " 127.0.0.0/8, ::1 ,localhost,")
    monkeypatch.setenv("REACH_WEBHOOK_SCHEDULE_S", "0, 0.5,2")
    settings = Settings()
    assert settings.webhook_allow == ["127.0.0.0/8", "::1", "localhost"]
    assert settings.webhook_schedule_s == [0.0, 0.5, 2.0]


@pytest.mark.parametrize("schedule", ["", "1,-1", "soon"])
def test_a_schedule_must_be_non_negative_numbers(
    monkeypatch: pytest.MonkeyPatch, schedule: str
) -> None:
    monkeypatch.setenv("REACH_WEBHOOK_SCHEDULE_S", schedule)
    with pytest.raises(ValidationError):
        Settings()
