"""Tenants and their keys: who is calling, what the key allows, and what a tenant may hold.

keys       the token format, the hash, and ``Principal`` (pure)
key_store  keys in Postgres: create, revoke, list, look up
heavy      a tenant's reads whose cost grows with its history, one at a time per kind
usage      the bytes a tenant's tasks, sessions and webhook deliveries hold, as Postgres counts
           them, its event logs, as Redis counts them, and the quotas on them
"""
