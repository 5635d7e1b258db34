"""The threads pool (``-P threads``), with a direct path for async handlers.

Celery's threads pool runs every task in a thread of its own. For an ``async def`` handler
that thread only waits: for the claim, for the coroutine on the process's event loop, for the
finish. With 500 calls in flight that is 500 threads handing the GIL to each other several
times a call. Here a run message for a capability whose handler is async skips the thread:
the pool hands it to the event loop, where ``Runner.run_async`` claims, calls and finishes it
among the other calls in flight, and the loop calls Celery's callback (which acks the message)
when it ends. Everything else (sync handlers, the janitor's and webhooks' tasks) runs in the
pool's threads as before.

Nothing about delivery changes: the message is acked (late) only after the task's final state
is written, so a process that dies leaves it unacked and it is delivered again; a warm
shutdown waits for the calls in flight (each has its deadline) before the pool stops. If the
direct path fails (Postgres or Redis away), the message goes to a thread, where Celery's own
retry of the run task takes it, as on the threads pool.

The worker uses it when it is started with ``-P threads``: ``use_direct_pool`` swaps the pool
class in at ``worker_init``, before the pool is made.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import concurrency
from celery.concurrency import thread

from broker.tasks.dispatch import RUN_TASK
from workers.runner import Runner

log = logging.getLogger("reach.worker")


class Direct:
    """The run messages this process's event loop takes without a thread, and the calls of
    them in flight."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._lock = threading.Condition()
        self._in_flight = 0

    def take(self, args: tuple[Any, ...] | None) -> tuple[str, str, str] | None:
        """(task id, queue, worker hostname) of a run message whose handler is async here;
        None for any other message."""
        if not args or args[0] != RUN_TASK or args[4] != "application/json":
            return None
        body = args[3]
        try:
            task_args = json.loads(bytes(body) if not isinstance(body, str) else body)[0]
            task_id, queue = task_args
        except (TypeError, ValueError, IndexError):
            return None  # Celery's tracer reports it
        spec = self.runner.registry.for_queue(queue)
        if spec is None or not spec.is_async:
            return None
        return str(task_id), str(queue), str(args[2].get("hostname") or "unknown")

    def submit(
        self, run: tuple[str, str, str], done: Callable[[Any], Any], fallback: Callable[[], Any]
    ) -> Any:
        """Run it on the loop. ``done``: Celery's callback, with what the tracer would give
        it; ``fallback``: the message's way through a thread, if the direct path fails."""
        with self._lock:
            self._in_flight += 1
        loop = self.runner.calls.loop
        return asyncio.run_coroutine_threadsafe(self._run(run, done, fallback), loop)

    async def _run(
        self, run: tuple[str, str, str], done: Callable[[Any], Any], fallback: Callable[[], Any]
    ) -> None:
        task_id, queue, hostname = run
        started = time.monotonic()
        try:
            try:
                status = await self.runner.run_async(task_id, queue, instance=hostname)
            except Exception as exc:
                log.warning("task %s: the direct path failed (%r); through a thread", task_id, exc)
                fallback()
                return
            try:
                done((0, repr(status), time.monotonic() - started))
            except Exception:  # the ack: the message stays unacked and comes again
                log.exception("task %s: Celery's callback failed", task_id)
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def wait(self) -> None:
        """Until no call is in flight (a warm shutdown)."""
        with self._lock:
            while self._in_flight:
                self._lock.wait()


class TaskPool(thread.TaskPool):  # type: ignore[misc]
    """``-P threads``, with async handlers' run messages taken by the event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct: Direct | None = getattr(self.app, "reach_direct", None)

    def on_apply(
        self,
        target: Any,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        **options: Any,
    ) -> Any:
        run = self.direct.take(args) if self.direct is not None and callback else None
        if run is None or self.direct is None or callback is None:
            return super().on_apply(target, args, kwargs, callback, accept_callback, **options)
        if accept_callback is not None:
            accept_callback(os.getpid(), time.monotonic())

        def through_a_thread() -> None:  # accepted already
            super(TaskPool, self).on_apply(target, args, kwargs, callback, None, **options)

        return thread.ApplyResult(self.direct.submit(run, callback, through_a_thread))

    def on_stop(self) -> None:
        if self.direct is not None:
            self.direct.wait()
        super().on_stop()


def use_direct_pool(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker started with ``-P threads`` gets this module's pool."""
    pool_cls = getattr(sender, "pool_cls", None)
    if pool_cls is not None and concurrency.get_implementation(pool_cls) is thread.TaskPool:
        sender.pool_cls = TaskPool
