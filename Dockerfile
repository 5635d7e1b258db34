# syntax=docker/dockerfile:1
#
# One image for every Agent-Reach process: the API (default CMD), `reach migrate`, the Celery
# workers, beat and flower. docker-compose.yml picks the process with `command:`.
# Configuration comes only from the environment (REACH_*); nothing secret is baked in.

# ---- build: install the project (no dev extras) into a self-contained virtualenv ----
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# Only what the wheels need; each pyproject.toml names its README.md as the readme.
# The client distribution first: the project depends on it, and it owns the `reach` command.
COPY client/pyproject.toml client/README.md ./client/
COPY client/reach_client ./client/reach_client
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY workers ./workers
COPY api ./api
COPY reach ./reach
COPY migrations ./migrations
RUN pip install ./client .

# ---- runtime ----
FROM python:3.11-slim

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

RUN groupadd --system --gid 10001 reach \
    && useradd --system --uid 10001 --gid reach --create-home --home-dir /home/reach reach

COPY --from=build /opt/venv /opt/venv

# Run from a directory without sources, so the installed package is what gets imported.
USER reach
WORKDIR /home/reach

EXPOSE 8000

CMD ["reach", "api", "--host", "0.0.0.0", "--port", "8000"]
