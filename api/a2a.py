"""Agent-Reach as an A2A 1.0 server, on ``a2a-sdk``'s route factories (JSON-RPC and HTTP+JSON).

A2A tasks are our tasks: the request handler below submits, reads, lists, cancels and streams
them through the same intake, tables and event log as the HTTP API, so any API process serves
any of them, and a key sees exactly what it sees there. The SDK's in-memory task store and
queue manager are not used. Every route takes the caller's bearer key first, then (for a body
not small) a token of its tenant's rate, and its body within the API's size and depth limits,
before the SDK parses it. A refusal A2A has no error for (a key not valid, a limit, an outage)
is answered as the API answers it, problem+json with its headers (``_a2a_error``). A bug in a
handler is answered as A2A's internal error in general terms and logged with its traceback: the
SDK's JSON-RPC dispatcher would send the exception's text (SQL, say) as the message. The mapping
is ``broker.facades.a2a``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler, validate_request_params
from a2a.server.routes import (
    add_a2a_routes_to_fastapi,
    create_jsonrpc_routes,
    create_rest_routes,
)
from a2a.server.routes.common import DefaultServerCallContextBuilder
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    HTTPAuthSecurityScheme,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SecurityRequirement,
    SecurityScheme,
    SendMessageRequest,
    StringList,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.constants import VERSION_HEADER
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.task import validate_history_length, validate_page_size
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from google.protobuf.json_format import MessageToDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from api import errors, replies
from api.deps import authenticate, read_metered_body
from api.services import Services, services
from api.sse import Slot
from broker import jsonbody
from broker.errors import BadRequest, Conflict, NotFound, ReachError
from broker.facades import a2a as mapping
from broker.registry import cards
from broker.remote.a2a_json import to_json, whole_in_place
from broker.tasks import queries
from broker.tasks.envelope import OPTIONS, parse_envelope
from broker.tasks.events import OUTPUT
from broker.tasks.resource import FINAL, TaskRow, parse_task_id, render
from broker.tasks.submission import Accepted
from broker.tenancy.keys import Principal
from broker.webhooks.subscriptions import set_callback, vet_callback

CARD_PATH = "/.well-known/agent-card.json"
JSONRPC_PATH = "/a2a/jsonrpc"
REST_PATH = "/a2a/rest"
BEARER = "bearer"
# The longest ``A2A-Version`` read as sent. The SDK parses the header with ``packaging``,
# whose integer parts meet Python's 4,300-digit limit: a longer run of digits raised
# ``ValueError`` there, outside any handler (JSON-RPC's internal error with Python's text,
# REST's 500). A longer header is cut to this and marked, so it is a version not served.
VERSION_HEADER_MAX = 32
# What the SDK's JSON-RPC dispatcher logs with ``logger.exception`` when it cannot read a
# request (its base fields, or a known method's params): the caller's own mistake, answered
# -32600 or -32602 with the reason, logged at ERROR with a traceback whose text holds the
# caller's input, as often as a tenant's rate allows. Kept as one INFO line (``_Mistaken``);
# and every line of the dispatcher's (its warning for each error answered carries the
# exception's text, which can hold the whole request) is cut at ``DISPATCHER_LINE_MAX``.
DISPATCHER_LOG = "a2a.server.routes.jsonrpc_dispatcher"
CALLERS_MISTAKES = frozenset(
    {"Failed to validate base JSON-RPC request", "Failed to parse request params"}
)
DISPATCHER_LINE_MAX = 500
LIST_PAGE_DEFAULT = 50
# ``totalSize`` counts the tasks a listing matches up to this many: a tenant of millions of
# tasks costs one bounded read (past it, the count says "at least this many").
LIST_COUNT_MAX = 10_000
# The statuses of refusals A2A has no error for: a key that is not valid (401), and a refusal
# for now (429, 503: a limit, an outage), which the same call may pass later. The SDK answers
# an error it does not know as its internal error (500, -32603), logged at ERROR.
# The levels above a message's data part: the JSON-RPC body, params, message, parts, the
# part (the HTTP+JSON body starts at the message's request, one fewer).
DATA_PART_LEVEL_RPC, DATA_PART_LEVEL_REST = 5, 4
ANSWERED_AS_THE_API = frozenset({401, 429, 503})
# And a refusal that asks for the same request again: A2A's -32602 told the caller its
# request was wrong.
ANSWERED_AS_THE_API_CODES = frozenset({"conflict_retry"})
# The SDK parses a request into protobuf in Python, value by value (about 2.5 us a value on
# the event loop, and as much again to read a data part back: a message of 250,000 small
# values took 1.2 s of it), and a number there is a double: 2**60 + 1 came out 2**60, and
# 10**400 was refused with no code of ours. So a message's data parts are taken out of the
# body before the SDK parses it, whatever their size, and the payload is our own parse's
# (``mapping.payload_of``); the rest of a request holds at most ``REQUEST_VALUES_MAX``.
REQUEST_VALUES_MAX = mapping.ANSWER_DATA_VALUES
JSON_PARSE_ERROR, INVALID_REQUEST = -32700, -32600

log = logging.getLogger("reach.api")


def _principal(context: ServerCallContext) -> Principal:
    principal = context.state.get("principal")
    if not isinstance(principal, Principal):  # the routes authenticate before the SDK runs
        raise InternalError(message="the request was not authenticated")
    return principal


def idempotency_key_of(message_id: str) -> str:
    """The submit's idempotency key for an A2A ``messageId``: a digest of the whole id, so any
    string A2A allows is a key (a key must be printable ASCII of at most 255 characters) and
    two ids are one key only if they are one id. The id's length is bounded by the body's."""
    return "a2a:" + hashlib.sha256(message_id.encode()).hexdigest()


def _a2a_error(exc: ReachError, context: ServerCallContext) -> A2AError:
    """Our refusal as an A2A error, keeping our stable code in ``data``. One A2A has no error
    for (``ANSWERED_AS_THE_API``) is kept on the request too, and ``_guarded`` answers it as
    the API does, problem+json with ``Retry-After`` or ``WWW-Authenticate``, in place of the
    SDK's answer: it can while nothing has been sent, which is when these arise (the SDK takes
    a stream's first event before it answers). A key revoked while a stream is under way ends
    the stream with the error returned here, the SDK's own: it has none for a key."""
    data = {"code": exc.code, **{k: v for k, v in exc.details.items() if _plain(v)}}
    if isinstance(exc, NotFound) and exc.code == "task_not_found":
        return TaskNotFoundError(message=exc.message, data=data)
    if errors.status_for(exc) in ANSWERED_AS_THE_API or exc.code in ANSWERED_AS_THE_API_CODES:
        context.state.setdefault("refusals", []).append(exc)
    return InvalidParamsError(message=exc.message, data=data)


def _plain(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | list | dict) or value is None


Method = TypeVar("Method", bound=Callable[..., Any])


def _bug_hidden(method: Method) -> Method:
    """``method`` with any exception but an A2A error logged and raised as A2A's internal
    error, naming nothing of it. Streams too: an error after their first event ends them."""

    def hidden(exc: Exception) -> InternalError:
        log.error("A2A %s failed", method.__name__, exc_info=exc)
        return InternalError(message=errors.BUG_MESSAGE)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streamed(*args: Any, **kwargs: Any) -> AsyncGenerator[Any]:
            try:
                async with contextlib.aclosing(method(*args, **kwargs)) as events:
                    async for event in events:
                        yield event
            except A2AError:
                raise
            except Exception as exc:
                raise hidden(exc) from None

        return streamed  # type: ignore[return-value]

    @functools.wraps(method)
    async def called(*args: Any, **kwargs: Any) -> Any:
        try:
            return await method(*args, **kwargs)
        except A2AError:
            raise
        except Exception as exc:
            raise hidden(exc) from None

    return called  # type: ignore[return-value]


Handler = TypeVar("Handler", bound=type[RequestHandler])


def _served(cls: Handler) -> Handler:
    """Every A2A method of ``cls`` (``on_*``) with its request's REQUIRED fields checked, as
    the SDK's own handler has them (-32602 naming each field missing: a message without
    ``messageId`` was taken, and A2A's idempotency is keyed on it), behind ``_bug_hidden``."""
    for name, member in list(vars(cls).items()):
        if name.startswith("on_") and callable(member):
            setattr(cls, name, _bug_hidden(validate_request_params(member)))
    return cls


@_served
class ReachRequestHandler(RequestHandler):
    """The A2A methods on our tasks. ``contextId`` is the session (``mapping.context_of``)."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    # -- sending -------------------------------------------------------------------------

    async def _submit(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> tuple[Principal, Accepted]:
        caller = _principal(context)
        validate_history_length(params.configuration)
        if params.message.task_id:
            raise UnsupportedOperationError(
                message="a task here takes one message: send a new message, without taskId"
            )
        callback = None
        if params.configuration.HasField("task_push_notification_config"):
            try:
                callback = mapping.callback_of(params.configuration.task_push_notification_config)
            except mapping.BadPushConfig as exc:
                raise InvalidParamsError(message=str(exc)) from None
        request_metadata = to_json(params.metadata) if params.HasField("metadata") else {}
        lifted = context.state.pop("lifted", None) or {}
        options = context.state.pop("options", None) or {}
        try:
            fields = mapping.envelope_fields(params.message, request_metadata, lifted, options)
        except mapping.ContentNotSupported as exc:
            raise ContentTypeNotSupportedError(message=str(exc)) from None
        except mapping.NotAnEnvelope as exc:
            raise InvalidParamsError(message=str(exc)) from None
        finally:
            # Taken once: the request (``request.state.lifted``, the same dict) lasts as
            # long as a blocking wait or a stream does, and the parts are its payload.
            lifted.clear()
        if params.message.message_id:
            # A message resent with the same id is the same request: A2A's idempotency.
            fields["idempotency_key"] = idempotency_key_of(params.message.message_id)
        fields["source"] = "a2a"
        await self._token(caller, context)
        try:
            envelope = parse_envelope(fields)
            accepted = await self.svc.intake.submit(
                caller,
                envelope,
                trace_id=context.state.get("trace_id") or uuid.uuid4().hex,
                callback=callback,
            )
        except ReachError as exc:
            raise _a2a_error(exc, context) from None
        return caller, accepted

    async def _token(self, caller: Principal, context: ServerCallContext) -> None:
        """A token of the tenant's rate for a call that writes, unless its body took one
        before it was read (a body over 4 KiB: ``read_metered_body``)."""
        if context.state.get("metered"):
            return
        try:
            await self.svc.door.take(caller.tenant)
        except ReachError as exc:
            raise _a2a_error(exc, context) from None

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        """Blocking: our sync mode (the task once final, or as it stands when the wait ends,
        or as accepted when an outage cuts it: ``replies.waited``; an error once the key is
        revoked). ``return_immediately``: our async mode."""
        caller, accepted = await self._submit(params, context)
        row = accepted.row
        if params.configuration.return_immediately:
            return mapping.task_of(render(row))
        wait_s = self.svc.settings.sync_max_wait_s
        try:
            receive = context.state.get("receive")
            task, _ = await replies.waited(self.svc, caller, row, wait_s, receive=receive)
        except ReachError as exc:  # the key was revoked meanwhile
            raise _a2a_error(exc, context) from None
        return mapping.task_of(task)

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        """The task as accepted, then its events. A message resent (the same ``messageId``)
        is the same request: its task as it stands now, then its events from there on, as
        ``SubscribeToTask`` has them, and nothing more once it is final. Its whole log again
        took its state back (a COMPLETED task's stream went on with SUBMITTED, WORKING)."""
        with self._stream_slot(context):  # before the task is written, as for POST /tasks
            caller, accepted = await self._submit(params, context)
            if accepted.replayed:
                task_id = str(accepted.row["id"])
                after, outputs = await self.svc.hub.tally(task_id, OUTPUT)  # before the row
                row = await self._visible(caller, task_id)
                async for event in self._from(caller, row, context, after, outputs):
                    yield event
                return
            rendered = render(accepted.row)
            yield mapping.task_of(rendered)
            async for event in self._events(caller, rendered, context, after=0):
                yield event

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        """The task as it stands, then its events from there on.

        Where the log stands is read before the task: a task that ends between the two reads
        is final when read (refused, as any final task is), or its final event comes after
        that place. Read the other way round, that event was behind the place the stream
        started from, and the stream ended at once on WORKING.

        The task is looked up once before that too: the log of a task the caller may not
        see, or of one already final, is not read (another tenant's task took as long to
        refuse as its log took to read, telling it from an unknown id)."""
        caller = _principal(context)
        task_id = parse_task_id(params.id)
        if task_id is None:
            raise TaskNotFoundError
        await self._unfinished(caller, params.id)
        # The log's place and its outputs so far, without holding a long log whole for as
        # long as the stream lasts.
        after, outputs = await self.svc.hub.tally(str(task_id), OUTPUT)
        row = await self._unfinished(caller, params.id)
        with self._stream_slot(context):
            async for event in self._from(caller, row, context, after, outputs):
                yield event

    async def _from(
        self,
        caller: Principal,
        row: TaskRow,
        context: ServerCallContext,
        after: int,
        outputs: int,
    ) -> AsyncGenerator[Any]:
        """The task as ``row`` has it, then its events after ``after`` (read before the
        row), ``outputs`` of them outputs already; nothing more when it is final."""
        rendered = render(row)
        yield mapping.task_of(rendered)
        if rendered["status"] in FINAL:
            return
        mapper = mapping.EventMapper(rendered["task_id"], mapping.context_of(rendered))
        mapper.outputs = outputs
        async for event in self._events(caller, rendered, context, after=after, mapper=mapper):
            yield event

    async def _unfinished(self, caller: Principal, task_id: str) -> TaskRow:
        """The caller's task, not final yet; else the A2A error."""
        row = await self._visible(caller, task_id)
        if row["status"] in FINAL:
            raise UnsupportedOperationError(message=f"the task is already {row['status']}")
        return row

    def _stream_slot(self, context: ServerCallContext) -> Slot:
        """One of the tenant's stream slots (``api.sse.StreamSlots``), or the A2A error."""
        try:
            return self.svc.streams.take(_principal(context).tenant)
        except ReachError as exc:
            raise _a2a_error(exc, context) from None

    async def _events(
        self,
        caller: Principal,
        task: Mapping[str, Any],
        context: ServerCallContext,
        *,
        after: int,
        mapper: mapping.EventMapper | None = None,
    ) -> AsyncGenerator[mapping.StreamEvent]:
        """The task's events as A2A stream events, while the caller's key is valid: once it is
        revoked, the SDK ends the stream with the error (JSON-RPC's error response, REST's
        ``error`` event)."""
        mapper = mapper or mapping.EventMapper(task["task_id"], mapping.context_of(task))
        try:
            async for event in replies.task_events(self.svc, caller, task["task_id"], after=after):
                if event is None:
                    continue
                for a2a_event in mapper.map(event.type, event.data):
                    yield a2a_event
        except ReachError as exc:
            raise _a2a_error(exc, context) from None

    # -- reading and cancelling ----------------------------------------------------------

    async def _visible(self, caller: Principal, task_id: str) -> TaskRow:
        try:
            return await queries.visible_task(self.svc.engine, caller, task_id)
        except NotFound:
            raise TaskNotFoundError from None

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task:
        validate_history_length(params)  # a task here holds no history: nothing else to do
        return mapping.task_of(render(await self._visible(_principal(context), params.id)))

    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        """The key's tasks, newest first; ``totalSize`` counts every page's, up to
        ``LIST_COUNT_MAX``; ``statusTimestampAfter``: those whose status moved since."""
        caller = _principal(context)
        validate_history_length(params)
        if context.state.get("unread_status") is not None:
            raise InvalidParamsError(message="status names no task state (TASK_STATE_...)")
        if params.HasField("page_size"):
            validate_page_size(params.page_size)  # 1 to 100, as A2A has it
        statuses = mapping.STATUSES_OF.get(params.status) if params.status else None
        if params.status and statuses is None:
            return ListTasksResponse(page_size=0)  # INPUT_REQUIRED and the like: none here
        wanted = params.page_size if params.HasField("page_size") else LIST_PAGE_DEFAULT
        limit = min(wanted, self.svc.settings.list_page_max)
        moved_after = None
        if params.HasField("status_timestamp_after"):
            moved_after = params.status_timestamp_after.ToDatetime(tzinfo=UTC)
        alone = mapping.task_of_context(params.context_id)
        try:
            # A GET's parameters never pass the body's checks: a NUL bound for SQL is refused.
            jsonbody.check_tree([params.context_id, params.page_token], max_depth=1)
            if alone is not None:
                found = await self._in_own_context(caller, alone, statuses, moved_after)
                next_cursor, total = None, len(found)
            else:
                listed: dict[str, Any] = {
                    "status": statuses,
                    "patterns": caller.sees,
                    "session_id": params.context_id or None,
                    "moved_after": moved_after,
                }
                async with self.svc.heavy_reads.turn(caller.tenant, "list"):
                    found, next_cursor = await queries.list_tasks(
                        self.svc.engine,
                        caller.tenant,
                        capability=None,
                        limit=limit,
                        cursor=params.page_token or None,
                        max_bytes=self.svc.settings.list_page_max_bytes,
                        **listed,
                    )
                    total = len(found)
                    if next_cursor is not None or params.page_token:  # more than this page
                        total = await queries.count_tasks(
                            self.svc.engine, caller.tenant, at_most=LIST_COUNT_MAX, **listed
                        )
        except ReachError as exc:
            raise _a2a_error(exc, context) from None
        # One answer: its tasks' results share its data values (``mapping.DataBudget``).
        budget, artifacts = mapping.DataBudget(), params.include_artifacts
        return ListTasksResponse(
            tasks=[mapping.task_of(task, budget, artifacts=artifacts) for task in found],
            next_page_token=next_cursor or "",
            page_size=limit,
            total_size=total,
        )

    async def _in_own_context(
        self,
        caller: Principal,
        task_id: str,
        statuses: tuple[str, ...] | None,
        moved_after: datetime | None,
    ) -> list[dict[str, Any]]:
        """The task without a session whose own context was asked for (``context_of``), if
        the key sees it, it has a status asked for, and it moved after ``moved_after``."""
        try:
            row = await self._visible(caller, task_id)
        except TaskNotFoundError:
            return []
        task = render(row)
        moved = row["finished_at"] or row["started_at"] or row["created_at"]
        if task["session_id"] is not None or (statuses and task["status"] not in statuses):
            return []
        if moved_after is not None and moved <= moved_after:
            return []
        return [task]

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task:
        try:
            row = await self.svc.canceller.cancel_visible(_principal(context), params.id)
        except NotFound:
            raise TaskNotFoundError from None
        except Conflict as exc:
            raise TaskNotCancelableError(message=exc.message) from None
        return mapping.task_of(render(row))

    # -- push notifications (the task's callback) -------------------------------------------

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        """The task's callback becomes the push config (one per task: a new one replaces
        it), through the same guard as every callback URL."""
        caller = _principal(context)
        await self._token(caller, context)
        row = await self._visible(caller, params.task_id)
        try:
            callback = mapping.callback_of(params)
        except mapping.BadPushConfig as exc:
            raise InvalidParamsError(message=str(exc)) from None
        try:
            await vet_callback(
                self.svc.engine,
                self.svc.lookups,
                caller.tenant,
                callback["url"],
                allow=self.svc.settings.webhook_allow,
            )
        except ReachError as exc:
            raise _a2a_error(exc, context) from None
        await set_callback(self.svc.engine, caller.tenant, row["id"], callback)
        return mapping.push_config_of(params.task_id, callback)

    async def _push_config(
        self, caller: Principal, task_id: str, config_id: str | None
    ) -> TaskPushNotificationConfig:
        row = await self._visible(caller, task_id)
        try:
            config = mapping.push_config_of(task_id, row["callback"])
        except mapping.NotAPushConfig:
            raise InvalidParamsError(message="the task has no such push config") from None
        if config_id and config.id != config_id:
            raise InvalidParamsError(message="the task has no such push config")
        return config

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        return await self._push_config(_principal(context), params.task_id, params.id)

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        caller = _principal(context)
        row = await self._visible(caller, params.task_id)
        if not mapping.is_push(row["callback"]):
            return ListTaskPushNotificationConfigsResponse()
        config = mapping.push_config_of(params.task_id, row["callback"])
        return ListTaskPushNotificationConfigsResponse(configs=[config])

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        caller = _principal(context)
        await self._token(caller, context)
        config = await self._push_config(caller, params.task_id, params.id)
        row = await self._visible(caller, config.task_id)
        await set_callback(self.svc.engine, caller.tenant, row["id"], None)

    # -- the cards -----------------------------------------------------------------------

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        caller = _principal(context)
        base = str(context.state.get("base_url", "")).rstrip("/")
        card = public_card(base)
        if offered := await skills(self.svc, caller):  # else the public card's, to say how
            del card.skills[:]
            card.skills.extend(offered)
        return card


async def skills(svc: Services, caller: Principal) -> list[AgentSkill]:
    """One skill per capability the key may run, described by the card advertised last."""
    latest = await cards.latest_cards(svc.engine, svc.card_cache)
    return [skill_of(name, card) for name, card in cards.offered(latest, caller).items()]


def skill_of(capability: str, card: Mapping[str, Any]) -> AgentSkill:
    tags = [t["tag"] for t in card.get("tags") or [] if isinstance(t, dict) and "tag" in t]
    return AgentSkill(
        id=capability,
        name=card.get("display_name") or capability,
        description=card.get("description") or f"Runs the capability {capability}.",
        tags=tags or [capability],
        input_modes=["application/json", "text/plain"],
        output_modes=["application/json"],
    )


# The public card's one skill (A2A requires at least one): the real ones, a skill per
# capability, are on the extended card, per key.
ANY_CAPABILITY = AgentSkill(
    id="capabilities",
    name="Run a capability",
    description=(
        "Runs the capability named in the message's metadata.capability. Which capabilities "
        "an API key may run, one skill each, is on the authenticated extended card "
        "(GetExtendedAgentCard)."
    ),
    tags=["broker"],
    input_modes=["application/json", "text/plain"],
    output_modes=["application/json"],
)


def card_base(request: Request) -> str:
    """Where the cards say the A2A endpoints are: under ``REACH_PUBLIC_URL`` when it is set,
    else under the request's own scheme and Host."""
    named = services(request).settings.public_url
    return (named if named is not None else str(request.base_url)).rstrip("/")


def public_card(base_url: str) -> AgentCard:
    """The card anyone may read: how to call, and that a bearer key is required. Its skills
    are on the extended card, per key (``ANY_CAPABILITY`` says so)."""
    return AgentCard(
        name="Agent-Reach",
        description=(
            "A task broker for agents: each skill is a capability. Name it in the message's "
            "metadata.capability; the payload is the first data part, else the text."
        ),
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(
                url=base_url + JSONRPC_PATH, protocol_binding="JSONRPC", protocol_version="1.0"
            ),
            AgentInterface(
                url=base_url + REST_PATH, protocol_binding="HTTP+JSON", protocol_version="1.0"
            ),
        ],
        capabilities=AgentCapabilities(
            streaming=True, push_notifications=True, extended_agent_card=True
        ),
        security_schemes={
            BEARER: SecurityScheme(
                http_auth_security_scheme=HTTPAuthSecurityScheme(
                    scheme="Bearer", description="An Agent-Reach API key"
                )
            )
        },
        security_requirements=[SecurityRequirement(schemes={BEARER: StringList(list=[])})],
        default_input_modes=["application/json", "text/plain"],
        default_output_modes=["application/json"],
        skills=[ANY_CAPABILITY],
    )


class _ContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's context, carrying the key the route authenticated, the trace id and the base
    URL (for the extended card)."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state["principal"] = request.state.principal
        context.state["trace_id"] = getattr(request.state, "trace_id", None)
        context.state["base_url"] = card_base(request)
        context.state["metered"] = getattr(request.state, "metered", False)
        context.state["lifted"] = getattr(request.state, "lifted", {})
        context.state["options"] = getattr(request.state, "options", {})
        context.state["receive"] = request.receive  # a blocking wait ends when its client leaves
        context.state["unread_status"] = getattr(request.state, "unread_status", None)
        context.state["refusals"] = request.state.refusals  # ``_answered``
        return context


Endpoint = Callable[[Request], Awaitable[Response]]


def _guarded(endpoint: Endpoint, svc: Services, *, json_rpc: bool) -> Endpoint:
    """The endpoint behind our key check and body limits: a request the API would refuse is
    refused here the same way (problem+json), before the SDK parses anything. The tenant's
    token comes before a body is read, as for ``POST /tasks`` (``read_metered_body``: but a
    small body already here whole), so a caller out of tokens has no body read or parsed
    (429 ``rate_limited``); a message sent takes no second one. A JSON-RPC body that is not
    acceptable JSON gets JSON-RPC's answer: -32700 when it does not parse, -32600 when it
    breaks a limit (too deep, a number out of range), our ``code`` in ``data``."""

    async def guarded(request: Request) -> Response:
        _bounded_version(request)
        try:
            caller = request.state.principal = await authenticate(request)
            if request.method != "POST" or (not json_rpc and _bodiless(request)):
                request.state.unread_status = _unread_status(request)
                return await _answered(endpoint, request)
            raw, request.state.metered = await read_metered_body(
                request, caller, svc.settings.max_body_bytes
            )
        except ReachError as exc:
            return errors.problem_response(request, exc)
        try:
            # A data part is the task's payload, held to the depth it has in POST /tasks's
            # body, wherever it sits in this one; the rest of the request to the API's limit.
            max_depth = svc.settings.max_json_depth
            levels = DATA_PART_LEVEL_RPC if json_rpc else DATA_PART_LEVEL_REST
            document = jsonbody.parse(raw, max_depth=max_depth + levels)
            lifted = _lift_data_parts(document, json_rpc=json_rpc)
            request.state.options = _envelope_options(document, json_rpc=json_rpc)
            jsonbody.check_depth(document, max_depth=max_depth)
            for payload in lifted.values():
                jsonbody.check_payload_depth(payload, max_depth=max_depth)
            if jsonbody.more_values_than(document, REQUEST_VALUES_MAX):
                raise BadRequest(
                    f"an A2A request holds at most {REQUEST_VALUES_MAX} JSON values besides"
                    " its message's data part",
                    code="too_many_values",
                )
        except ReachError as exc:
            if not json_rpc:
                return errors.problem_response(request, exc)
            rpc_code = JSON_PARSE_ERROR if exc.code == "invalid_json" else INVALID_REQUEST
            error = {"code": rpc_code, "message": exc.message, "data": {"code": exc.code}}
            return JSONResponse({"jsonrpc": "2.0", "id": None, "error": error})
        if lifted:
            request.state.lifted = lifted
            raw = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
        request._body = raw  # the SDK reads it again: Starlette keeps it here
        return await _answered(endpoint, request)

    return guarded


async def _answered(endpoint: Endpoint, request: Request) -> Response:
    """The SDK's answer, or, when the handler refused the request with what A2A has no error
    for (``_a2a_error``), the API's: problem+json with ``Retry-After`` (429, 503) or
    ``WWW-Authenticate`` (401), as ``_guarded`` answers such a refusal before the SDK runs."""
    refusals: list[ReachError] = []
    request.state.refusals = refusals
    response = await endpoint(request)
    return errors.problem_response(request, refusals[0]) if refusals else response


def _lift_data_parts(document: Any, *, json_rpc: bool) -> dict[int, Any]:
    """The message's data parts that hold an object or an array, by their place among its
    parts, each left in ``document`` as ``{}``."""
    holder = document.get("params") if json_rpc and isinstance(document, dict) else document
    message = holder.get("message") if isinstance(holder, dict) else None
    parts = message.get("parts") if isinstance(message, dict) else None
    lifted: dict[int, Any] = {}
    for index, part in enumerate(parts if isinstance(parts, list) else ()):
        if isinstance(part, dict) and isinstance(part.get("data"), dict | list):
            lifted[index], part["data"] = whole_in_place(part["data"]), {}
    return lifted


def _envelope_options(document: Any, *, json_rpc: bool) -> dict[str, Any]:
    """The envelope's options a message sets (``envelope.OPTIONS``) in its metadata or
    its request's, as sent: the SDK reads them into protobuf, whose every number is a double
    (2**53 + 1 in a task's metadata was stored as 2**53)."""
    holder = document.get("params") if json_rpc and isinstance(document, dict) else document
    if not isinstance(holder, dict):
        return {}
    message = holder.get("message")
    found: dict[str, Any] = {}
    for metadata in (holder.get("metadata"), isinstance(message, dict) and message.get("metadata")):
        if isinstance(metadata, dict):  # the message's last: its own options win
            found.update((k, metadata[k]) for k in OPTIONS if k in metadata)
    whole_in_place(found)  # a client on protobuf sends 3 as 3.0
    return found


def _bounded_version(request: Request) -> None:
    """An ``A2A-Version`` longer than ``VERSION_HEADER_MAX`` cut to it, with ``...`` after:
    the SDK then answers it as any version it does not serve."""
    version = request.headers.get(VERSION_HEADER)
    if version is None or len(version) <= VERSION_HEADER_MAX:
        return
    name = VERSION_HEADER.lower().encode()
    cut = (version[:VERSION_HEADER_MAX] + "...").encode("latin-1")
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != name]
    request.scope["headers"] = [*headers, (name, cut)]
    with contextlib.suppress(AttributeError):
        del request._headers  # Starlette's copy, read from the scope again


class _Mistaken(logging.Filter):
    """The dispatcher's ``CALLERS_MISTAKES`` as one INFO line naming the exception's type, with
    no traceback (handlers at WARNING and above drop it); any line of its cut at
    ``DISPATCHER_LINE_MAX`` characters."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in CALLERS_MISTAKES and record.exc_info:
            error = record.exc_info[1]
            record.msg = f"{record.msg}: {type(error).__name__}"
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        line = record.getMessage()
        if len(line) > DISPATCHER_LINE_MAX:
            record.msg, record.args = f"{line[:DISPATCHER_LINE_MAX]} ... (cut)", None
        return True


def _quiet_callers_mistakes() -> None:
    dispatcher = logging.getLogger(DISPATCHER_LOG)
    if not any(isinstance(f, _Mistaken) for f in dispatcher.filters):
        dispatcher.addFilter(_Mistaken())


def _unread_status(request: Request) -> str | None:
    """A REST ``ListTasks``' ``status`` that names no task state (``on_list_tasks`` refuses
    it): the SDK reads query parameters ignoring what it cannot read, so ``status=BOGUS``
    listed every task, as no filter."""
    given = request.query_params.getlist("status")
    if not given:
        return None
    value = given[-1]  # the SDK's: the last one
    known = {*TaskState.keys(), *map(str, TaskState.values())}
    return None if not value or value in known else value


def _bodiless(request: Request) -> bool:
    """A POST that sends no body at all, as REST's SubscribeToTask: nothing to read or check
    (the body check refused it, 400, before the SDK ran)."""
    headers = request.headers
    return "transfer-encoding" not in headers and headers.get("content-length", "0") == "0"


def _guard(routes: list[BaseRoute], svc: Services, *, json_rpc: bool) -> list[BaseRoute]:
    """Each route behind ``_guarded``. The REST factory's ``/{tenant}`` mount (A2A's tenant in
    the path) is left out: at the root it would take every unknown path, and a key's tenant
    is its own here, never one a path names."""
    guarded: list[BaseRoute] = []
    for route in routes:
        if isinstance(route, Route):
            methods = sorted(m for m in route.methods or () if m != "HEAD")
            endpoint = _guarded(route.endpoint, svc, json_rpc=json_rpc)
            guarded.append(Route(route.path, endpoint, methods=methods))
    return guarded


def mount(app: FastAPI, svc: Services) -> None:
    _quiet_callers_mistakes()
    handler = ReachRequestHandler(svc)
    builder = _ContextBuilder()

    async def agent_card(request: Request) -> JSONResponse:
        """The public A2A agent card: where to call and how to sign in."""
        card = JSONResponse(MessageToDict(public_card(card_base(request))))
        if svc.settings.public_url is None:  # named after the request's Host: never shared
            card.headers["Cache-Control"] = "no-store"
        return card

    add_a2a_routes_to_fastapi(
        app,
        agent_card_routes=[Route(CARD_PATH, agent_card, methods=["GET"])],
        jsonrpc_routes=_guard(
            list(create_jsonrpc_routes(handler, JSONRPC_PATH, context_builder=builder)),
            svc,
            json_rpc=True,
        ),
        rest_routes=_guard(
            create_rest_routes(handler, context_builder=builder, path_prefix=REST_PATH),
            svc,
            json_rpc=False,
        ),
    )
