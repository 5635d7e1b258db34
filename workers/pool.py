"""The threads pool (``-P threads``), with a direct path for async handlers.

Celery's threads pool runs every task in a thread of its own. For an ``async def`` handler
that thread only waits: for the claim, for the coroutine on the process's event loop, for the
finish. With 500 calls in flight that is 500 threads handing the GIL to each other several
times a call. Here a run message for a capability whose handler is async skips the thread:
the pool hands it to the event loop, where ``Runner.run_async`` claims, calls and finishes it
among the other calls in flight, and the loop calls Celery's callback (which acks the message)
when it ends. Everything else (sync handlers, the janitor's and webhooks' tasks) runs in the
pool's threads as before.

Before the pool, Celery's strategy for the run task turns each message into a ``Request``
(decoding its body once to look for protocol 1), and its tracer wraps the run. A plain run
message skips both (``run_strategy``): an async handler's body goes to the loop as it came,
a sync handler's run to one of the pool's threads, and the message is acked when the run
ends. That took a sixth of the bridge's CPU a call and a fifth of a noop worker's
(``docs/performance.md``). Runs handed over while the loop is busy start in one turn of it.

Nothing about delivery changes: the message is acked (late) only after the task's final state
is written, so a process that dies leaves it unacked and it is delivered again; a warm
shutdown waits for the calls in flight (each has its deadline) before the pool stops. If the
direct path fails (Postgres or Redis away), the message goes to a thread, where Celery's own
retry of the run task takes it, as on the threads pool.

With a Redis broker the run queues' messages do not pass through Celery's consumer at all:
the event loop takes them itself (``workers.loop_consumer``) and starts their runs here
(``Direct.start``, ``Direct.submit_sync``); ``run_strategy`` serves the other brokers, and
the messages the loop hands back to Celery.

The worker uses it when it is started with ``-P threads``: ``use_direct_pool`` swaps the pool
class in at ``worker_init``, before the pool is made.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import concurrency
from celery.concurrency import thread
from celery.worker import strategy as celery_strategy

from broker import jsoncodec
from broker.tasks.dispatch import RUN_TASK
from workers import faults, loop_consumer
from workers.loop_consumer import CELERY_WAY
from workers.runner import Runner

log = logging.getLogger("reach.worker")
WAIT_POLL_S = 0.2  # how soon a warm shutdown's wait sees a cold one that came meanwhile


class Direct:
    """The run messages this process's event loop takes without a thread, and the calls of
    them in flight."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._lock = threading.Condition()
        self._in_flight = 0
        # A task id's runs in flight here: two messages of one task (a session's next turn
        # published again, a sweep's or a rehome's copy, a redelivery) may both be taken while
        # its run goes on. The one that loses the claim ends at once; the other still runs.
        self._held: collections.Counter[str] = collections.Counter()
        self._waiting: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._fails = faults.direct_fails()  # tests only: see workers.faults

    def take(self, args: tuple[Any, ...] | None) -> tuple[str, str, str] | None:
        """(task id, queue, worker hostname) of a run message whose handler is async here;
        None for any other message."""
        if not args or args[0] != RUN_TASK or args[4] != "application/json":
            return None
        return self.run_of(args[3], str(args[2].get("hostname") or "unknown"))

    def run_of(self, body: Any, hostname: str, sync: bool = False) -> tuple[str, str, str] | None:
        """(task id, queue, hostname) of a run message's JSON body, if its handler is async
        here (``sync``: or a sync handler)."""
        try:
            task_args = jsoncodec.loads(body)[0]
            task_id, queue = task_args
        except (TypeError, ValueError, IndexError):
            return None  # Celery's tracer reports it
        spec = self.runner.registry.for_queue(queue)
        if spec is None or not (spec.is_async or sync):
            return None
        return str(task_id), str(queue), hostname

    def is_async(self, queue: str) -> bool:
        spec = self.runner.registry.for_queue(queue)
        return spec is not None and spec.is_async

    def submit(
        self, run: tuple[str, str, str], done: Callable[[Any], Any], fallback: Callable[[], Any]
    ) -> concurrent.futures.Future[None]:
        """Run it on the loop. ``done``: Celery's callback, with what the tracer would give
        it; ``fallback``: the message's way through a thread, if the direct path fails. The
        runs handed over before the loop takes them start in one turn of it."""
        ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._in_flight += 1
            self._held[run[0]] += 1
            self._waiting.append((run, done, fallback, ended))
            wake = len(self._waiting) == 1
        if wake:
            self.runner.calls.loop.call_soon_threadsafe(self._start_waiting)
        return ended

    def start(
        self, run: tuple[str, str, str], done: Callable[[Any], Any], fallback: Callable[[], Any]
    ) -> None:
        """``submit`` for a caller on the loop itself (``workers.loop_consumer``)."""
        with self._lock:
            self._in_flight += 1
            self._held[run[0]] += 1
        task = asyncio.get_running_loop().create_task(self._run(run, done, fallback))
        self._tasks.add(task)  # the loop holds its tasks weakly
        task.add_done_callback(self._tasks.discard)

    def _start_waiting(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        loop = asyncio.get_running_loop()
        for run, done, fallback, ended in waiting:
            task = loop.create_task(self._run(run, done, fallback))
            self._tasks.add(task)  # the loop holds its tasks weakly
            task.add_done_callback(functools.partial(self._ended, ended))

    def _ended(self, ended: concurrent.futures.Future[None], task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        ended.set_result(None)

    def held(self) -> set[str]:
        """The task ids of the runs in flight here."""
        with self._lock:
            return set(self._held)  # only ids whose count is above zero are kept

    async def _run(
        self, run: tuple[str, str, str], done: Callable[[Any], Any], fallback: Callable[[], Any]
    ) -> None:
        task_id, queue, hostname = run
        started = time.monotonic()
        try:
            try:
                if self._fails and queue in self._fails:
                    raise ConnectionError("fault injected: the direct path fails")
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
                self._let_go(task_id)
                self._lock.notify_all()

    def submit_sync(
        self,
        run: tuple[str, str, str],
        done: Callable[[], Any],
        fallback: Callable[[], Any],
        executor: concurrent.futures.Executor,
    ) -> None:
        """A sync handler's run, in one of the pool's threads, without Celery's request. A
        warm shutdown lets the pool's threads finish the runs they started and cancels the
        rest, whose messages, never acked, come again (Celery's threads pool)."""
        task_id = run[0]
        with self._lock:
            self._held[task_id] += 1
        try:
            future = executor.submit(self._run_sync, run, done, fallback)
        except BaseException:
            self._release(task_id)
            raise
        future.add_done_callback(lambda _: self._release(task_id))

    def _run_sync(
        self, run: tuple[str, str, str], done: Callable[[], Any], fallback: Callable[[], Any]
    ) -> None:
        task_id, queue, hostname = run
        try:
            if self._fails and queue in self._fails:
                raise ConnectionError("fault injected: the direct path fails")
            self.runner.run(task_id, queue, instance=hostname)
        except Exception as exc:
            log.warning("task %s: the direct path failed (%r); Celery's way", task_id, exc)
            fallback()
            return
        try:
            done()
        except Exception:  # the ack: the message stays unacked and comes again
            log.exception("task %s: its ack failed", task_id)

    def _release(self, task_id: str) -> None:
        with self._lock:
            self._let_go(task_id)

    def _let_go(self, task_id: str) -> None:
        """One run of ``task_id`` ended; with the lock held."""
        left = self._held[task_id] - 1
        if left > 0:
            self._held[task_id] = left
        else:
            self._held.pop(task_id, None)

    def wait(self, given_up: Callable[[], bool]) -> bool:
        """Until no call is in flight (a warm shutdown): True; or until ``given_up()`` (a
        cold shutdown came meanwhile, from the signal handler, which returns here): False."""
        with self._lock:
            if self._in_flight:
                log.info("warm shutdown: waiting for %d runs in flight", self._in_flight)
            while self._in_flight:
                if given_up():
                    return False
                self._lock.wait(WAIT_POLL_S)
        return True


class ApplyResult(thread.ApplyResult):  # type: ignore[misc]
    """A run in this pool, as a Celery request holds it."""

    def terminate(self, signal: int | None = None) -> None:
        """A revoke with ``terminate``: nothing to kill. A thread cannot be stopped and a
        coroutine is no process; the cancel reaches the run through its flag
        (``ctx.cancelled``, ``CancelledError``)."""


class TaskPool(thread.TaskPool):  # type: ignore[misc]
    """``-P threads``, with async handlers' run messages taken by the event loop."""

    def terminate_job(self, pid: int, signal: int | None = None) -> None:
        """A revoke with ``terminate`` of a run with Celery's request (task events on, or
        a countdown's): Celery's thread pool raised ``NotImplementedError``, logged with its
        traceback for every cancel of a cancellable card's task (every remote agent's). The
        cancel reaches the run through its flag, as ``ApplyResult.terminate`` says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct: Direct | None = getattr(self.app, "reach_direct", None)
        self.loop_consumer: loop_consumer.LoopConsumer | None = getattr(
            self.app, "reach_loop_consumer", None
        )

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
            applied = super().on_apply(target, args, kwargs, callback, accept_callback, **options)
            return ApplyResult(applied.f)
        if accept_callback is not None:
            accept_callback(os.getpid(), time.monotonic())

        def through_a_thread() -> None:  # accepted already
            super(TaskPool, self).on_apply(target, args, kwargs, callback, None, **options)

        return ApplyResult(self.direct.submit(run, callback, through_a_thread))

    def on_stop(self) -> None:
        """A warm shutdown: the runs in flight end, then their acks are sent. A cold one
        (also one that comes while a warm one waits) does not wait for the coroutines: their
        messages go back on their queues (a sync handler's thread cannot be stopped, and is
        waited for, as Celery's pool does)."""
        from celery.worker import state

        if state.should_terminate or (
            self.direct is not None and not self.direct.wait(lambda: bool(state.should_terminate))
        ):
            if self.loop_consumer is not None:
                self.loop_consumer.put_back()
            super().on_stop()
            return
        super().on_stop()
        if self.loop_consumer is not None:
            self.loop_consumer.settle()

    def on_terminate(self) -> None:
        """A cold shutdown: the messages of the runs still in flight go back on their queues,
        as kombu's channel puts back its own."""
        if self.loop_consumer is not None:
            self.loop_consumer.put_back()
        super().on_terminate()


def use_direct_pool(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker started with ``-P threads`` gets this module's pool."""
    pool_cls = getattr(sender, "pool_cls", None)
    if pool_cls is not None and concurrency.get_implementation(pool_cls) is thread.TaskPool:
        sender.pool_cls = TaskPool


def run_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """The run task's strategy: Celery's, with a short way for a plain run message (see
    ``plain``) whose handler is served here. Celery's strategy decodes the body to look for
    protocol 1, builds a ``Request`` and hands it to the pool, whose tracer runs it; the short
    way hands an async handler's run to the event loop and a sync handler's to a pool thread,
    and acks the message when the run ends. The lease keeper counts those runs as held
    (``Direct.held``); if one fails before its claim, its message takes Celery's way."""
    default: Callable[..., Any] = celery_strategy.default(task, app, consumer, **kwargs)
    direct: Direct | None = getattr(app, "reach_direct", None)
    if direct is None or not isinstance(consumer.pool, TaskPool) or consumer.hub is None:
        return default
    revoked = consumer.controller.state.revoked
    dispatcher = consumer.event_dispatcher
    hostname = consumer.hostname
    hub = consumer.hub
    pool = consumer.pool
    connection_errors = consumer.connection_errors

    def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **more: Any) -> Any:
        run = None
        if body is None and not callbacks and plain(message, revoked, dispatcher):
            run = direct.run_of(message.body, hostname, sync=True)
        if run is None:
            return default(message, body, ack, reject, callbacks, **more)

        def through_celery() -> None:  # back on the consumer's thread, as it came
            hub.call_soon(default, message, body, ack, reject, callbacks)

        def acked() -> None:
            ack(log, connection_errors)

        if direct.is_async(run[1]):
            direct.submit(run, lambda _: acked(), through_celery)
        else:
            direct.submit_sync(run, acked, through_celery, pool.executor)
        return None

    return handler


def plain(message: Any, revoked: Any, dispatcher: Any) -> bool:
    """Whether a run message may skip Celery's request (``workers.loop_consumer.plain``); not one
    the loop consumer handed to Celery because its direct path failed."""
    if message.properties.get(CELERY_WAY):
        return False
    events = loop_consumer.events_on(dispatcher)
    return loop_consumer.plain(message.content_type, message.headers, revoked, events)
