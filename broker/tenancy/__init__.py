"""Tenants and their keys: who is calling and what the key allows.

keys       the token format, the hash, and ``Principal`` (pure)
key_store  keys in Postgres: create, revoke, list, look up
"""
