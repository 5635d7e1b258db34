"""Ids that must be unique, not secret (``broker.ids``)."""

from __future__ import annotations

import os
import re

import pytest

from broker.ids import unique_hex
from broker.webhooks import signing


@pytest.mark.parametrize("bits", [64, 128])
def test_given_many_ids_expect_each_its_width_in_lowercase_hex_and_all_distinct(bits: int) -> None:
    ids = [unique_hex(bits) for _ in range(10_000)]
    assert all(re.fullmatch(f"[0-9a-f]{{{bits // 4}}}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_given_a_forked_child_expect_its_ids_not_the_parents() -> None:
    """A prefork worker's children would otherwise draw the same ids, message for message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, " ".join(unique_hex(128) for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 1024).decode().split()
    os.close(read)
    parent = [unique_hex(128) for _ in range(3)]
    assert len(child) == 3
    assert not set(child) & set(parent)


def test_given_message_ids_expect_msg_and_distinct() -> None:
    ids = {signing.message_id() for _ in range(1_000)}
    assert len(ids) == 1_000
    assert all(re.fullmatch("msg_[0-9a-f]{32}", i) for i in ids)
