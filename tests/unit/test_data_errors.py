"""A value the database refuses answers 422 ``invalid_data``, whichever layer raised it:
SQLAlchemy's engine wraps psycopg's errors, a ``LoopConnection`` does not."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api import errors


@pytest.mark.parametrize(
    "refusal",
    [
        psycopg.errors.NumericValueOutOfRange("smallint out of range"),
        sqlalchemy.exc.DataError("INSERT", {}, Exception("smallint out of range")),
    ],
)
def test_a_refused_value_is_422_invalid_data(refusal: Exception) -> None:
    app = FastAPI()
    errors.install(app)

    @app.get("/refused")
    def refused() -> None:
        raise refusal

    answer = TestClient(app, raise_server_exceptions=False).get("/refused")
    assert answer.status_code == 422
    assert answer.json()["code"] == "invalid_data"
