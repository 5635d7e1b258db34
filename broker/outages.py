"""Outages: which exceptions from outside the error tree (``broker/errors.py``) mean that a
call failed for want of a network or a service, not for a bug.

Two groups decide what is tried again; they never overlap, and they are not the same thing:

    INFRASTRUCTURE_ERRORS    our own Postgres or Redis cannot be reached (SQLAlchemy,
                             psycopg and redis-py classes). What we were doing is tried again
                             later (a Celery message, a group of inserts) or the API answers
                             503; it is never counted as the agent's failure.
    AGENT_TRANSIENT_ERRORS   what an agent's own calls raise when the network failed them (the
                             built-in ``ConnectionError`` and ``TimeoutError``). The task fails
                             with ``transient_error``, retryable: it runs again while attempts
                             remain.
"""

from __future__ import annotations

import psycopg
import redis.exceptions
import sqlalchemy.exc

# See the module docstring for the difference between the two.
INFRASTRUCTURE_ERRORS = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    psycopg.OperationalError,  # a worker's loop statements go out on psycopg alone
    psycopg.InterfaceError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
AGENT_TRANSIENT_ERRORS = (ConnectionError, TimeoutError)
# What a request answers as "unavailable, try again" (HTTP 503, an MCP or A2A refusal): the
# outages above, no pooled connection coming free in time (the pool's TimeoutError), and a
# built-in ConnectionError that a client library let through unwrapped.
UNAVAILABLE_ERRORS = (*INFRASTRUCTURE_ERRORS, sqlalchemy.exc.TimeoutError, ConnectionError)
# A value Postgres refused (a request's data, not our fault nor an outage); the grouped
# inserts go out on a psycopg connection of their own, hence its class too.
REFUSED_VALUE_ERRORS = (sqlalchemy.exc.DataError, psycopg.DataError)
