"""The operator's tools, outside the domain: the ``reach`` command, the dev stack, finding or
starting local Postgres and Redis, and running the migrations."""
