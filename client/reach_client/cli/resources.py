"""``reach agents``, ``reach capabilities``, ``reach sessions ...`` and ``reach webhooks ...``."""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from rich.text import Text

from reach_client.cli import exits, render
from reach_client.cli.arguments import (
    PAGE_MAX,
    comma_list,
    count,
    identifier,
    json_object,
    open_client,
)
from reach_client.models import Session, Webhook


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    agents = sub.add_parser("agents", parents=[common], help="agents and their instances")
    agents.add_argument("agent_id", nargs="?", help="one agent's cards and instances")
    agents.set_defaults(handler=run_agents)
    capabilities = sub.add_parser(
        "capabilities", parents=[common], help="capabilities: instances, success, latency"
    )
    capabilities.set_defaults(handler=run_capabilities)
    _sessions(sub, common)
    _webhooks(sub, common)


def _verb(verbs: Any, common: argparse.ArgumentParser, name: str, text: str, handler: Any) -> Any:
    command = verbs.add_parser(name, parents=[common], help=text)
    command.set_defaults(handler=handler)
    return command


def _sessions(sub: Any, common: argparse.ArgumentParser) -> None:
    verbs = sub.add_parser("sessions", help="conversation state with revisions").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    listing = _verb(verbs, common, "list", "the live sessions, newest first", run_session_list)
    listing.add_argument("--limit", type=count, default=20, help="how many to show [20]")
    create = _verb(verbs, common, "create", "a new session (revision 1)", run_session_create)
    create.add_argument("--state", type=json_object, default={})
    create.add_argument("--metadata", type=json_object)
    create.add_argument("--ttl-s", type=int)
    _verb(verbs, common, "get", "a session", run_session_get).add_argument(
        "session_id", type=identifier
    )
    update = _verb(verbs, common, "update", "replace the state at a revision", run_session_update)
    update.add_argument("session_id", type=identifier)
    update.add_argument("--state", type=json_object, required=True)
    update.add_argument("--metadata", type=json_object)
    update.add_argument("--revision", type=int, required=True, help="the revision you read")
    patch = _verb(verbs, common, "patch", "merge-patch (RFC 7396) at a revision", run_session_patch)
    patch.add_argument("session_id", type=identifier)
    patch.add_argument("--patch", type=json_object, required=True, help='{"state": {...}}')
    patch.add_argument("--revision", type=int, required=True)
    _verb(verbs, common, "delete", "delete a session", run_session_delete).add_argument(
        "session_id", type=identifier
    )
    revisions = _verb(verbs, common, "revisions", "its last revisions", run_session_revisions)
    revisions.add_argument("session_id", type=identifier)
    revisions.add_argument("--limit", type=count)


def _webhooks(sub: Any, common: argparse.ArgumentParser) -> None:
    verbs = sub.add_parser("webhooks", help="tenant-wide signed callbacks").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    create = _verb(verbs, common, "create", "subscribe a URL (prints its secret once)", run_hook)
    create.add_argument("hook_url", metavar="URL", help="the receiver's URL")
    create.add_argument("--events", type=comma_list, help="e.g. task.succeeded,task.failed")
    create.add_argument("--capabilities", type=comma_list, help="patterns, e.g. 'invoice.*'")
    create.add_argument("--description")
    _verb(verbs, common, "list", "the subscriptions", run_hooks)
    _verb(verbs, common, "get", "a subscription", run_hook_get).add_argument(
        "webhook_id", type=identifier
    )
    _verb(verbs, common, "delete", "unsubscribe", run_hook_delete).add_argument(
        "webhook_id", type=identifier
    )
    deliveries = _verb(verbs, common, "deliveries", "its deliveries, newest first", run_deliveries)
    deliveries.add_argument("webhook_id", type=identifier)
    deliveries.add_argument("--limit", type=count, default=20)


def run_agents(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = [reach.agents.get(args.agent_id)] if args.agent_id else reach.agents.list()
    if args.json:
        render.emit_json(found[0].raw if args.agent_id else [a.raw for a in found])
        return exits.OK
    rows = [
        (
            a.agent_id,
            ", ".join(a.capabilities),
            ", ".join(sorted({str(c.get("version")) for c in a.cards})),
            f"{a.live_instances}/{len(a.instances)}",
        )
        for a in found
    ]
    columns = ("agent", "capabilities", "versions", "live/instances")
    render.stdout().print(render.table(None, columns, rows))
    return exits.OK


def run_capabilities(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = reach.capabilities.list()
    if args.json:
        render.emit_json([c.raw for c in found])
        return exits.OK
    rows = [
        (
            c.capability,
            c.live_instances,
            c.measured.get("tasks"),
            f"{c.success_rate:.0%}" if c.success_rate is not None else None,
            c.measured.get("p50_run_s"),
            c.measured.get("p95_run_s"),
            c.queue_depth,
        )
        for c in found
    ]
    columns = ("capability", "live", "tasks 5m", "success", "p50 s", "p95 s", "queued")
    render.stdout().print(render.table(None, columns, rows))
    return exits.OK


def show_session(args: argparse.Namespace, session: Session) -> int:
    if args.json:
        render.emit_json(session.raw)
        return exits.OK
    out = render.stdout()
    shown = render.printable
    out.print(f"session {shown(session.session_id)}  revision {shown(session.revision)}")
    out.print(f"expires {render.when(session.expires_at)}")
    render.print_json(out, session.state)
    return exits.OK


def run_session_list(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = reach.sessions.list(limit=min(max(args.limit, 1), PAGE_MAX))
        shown = list(itertools.islice(found, max(args.limit, 0)))
    if args.json:
        render.emit_json([s.raw for s in shown])
        return exits.OK
    rows = [
        (s.session_id, s.revision, render.when(s.updated_at), render.when(s.expires_at))
        for s in shown
    ]
    columns = ("session", "revision", "updated", "expires")
    render.stdout().print(render.table(None, columns, rows))
    return exits.OK


def run_session_create(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        created = reach.sessions.create(args.state, metadata=args.metadata, ttl_s=args.ttl_s)
    return show_session(args, created)


def run_session_get(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        return show_session(args, reach.sessions.get(args.session_id))


def run_session_update(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        written = reach.sessions.update(
            args.session_id, args.state, revision=args.revision, metadata=args.metadata
        )
    return show_session(args, written)


def run_session_patch(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        written = reach.sessions.patch(args.session_id, args.patch, revision=args.revision)
    return show_session(args, written)


def run_session_delete(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        reach.sessions.delete(args.session_id)
    if args.json:
        render.emit_json({"session_id": args.session_id, "deleted": True})
    else:
        render.stdout().print(f"deleted session {args.session_id}")
    return exits.OK


def run_session_revisions(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = reach.sessions.revisions(args.session_id, limit=args.limit)
    if args.json:
        render.emit_json([r.raw for r in found])
        return exits.OK
    rows = [
        (r.revision, render.when(r.created_at), r.task_id, json.dumps(r.state)[:80]) for r in found
    ]
    render.stdout().print(render.table(None, ("revision", "at", "task", "state"), rows))
    return exits.OK


def show_hook(args: argparse.Namespace, hook: Webhook) -> int:
    if args.json:
        render.emit_json(hook.raw)
        return exits.OK
    out, shown = render.stdout(), render.printable
    webhook_id, url = shown(hook.webhook_id), shown(hook.url)
    out.print(Text.assemble(f"webhook {webhook_id}  ", render.status(hook.status), f"  {url}"))
    out.print(f"events: {shown(', '.join(hook.events))}")
    if hook.capabilities:
        out.print(f"capabilities: {shown(', '.join(hook.capabilities))}")
    if hook.secret:
        out.print(f"secret: {shown(hook.secret)}  (shown once: keep it to verify calls)")
    return exits.OK


def run_hook(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        created = reach.webhooks.create(
            args.hook_url,
            events=args.events,
            capabilities=args.capabilities,
            description=args.description,
        )
    return show_hook(args, created)


def run_hook_get(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        return show_hook(args, reach.webhooks.get(args.webhook_id))


def run_hook_delete(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        reach.webhooks.delete(args.webhook_id)
    if args.json:
        render.emit_json({"webhook_id": args.webhook_id, "deleted": True})
    else:
        render.stdout().print(f"deleted webhook {args.webhook_id}")
    return exits.OK


def run_hooks(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = reach.webhooks.list()
    if args.json:
        render.emit_json([h.raw for h in found])
        return exits.OK
    rows = [
        (h.webhook_id, render.status(h.status), h.url, ", ".join(h.events), h.description)
        for h in found
    ]
    columns = ("webhook", "status", "url", "events", "description")
    render.stdout().print(render.table(None, columns, rows))
    return exits.OK


def run_deliveries(args: argparse.Namespace) -> int:
    with open_client(args) as reach:
        found = reach.webhooks.deliveries(args.webhook_id, limit=min(args.limit, 100))
        shown = list(itertools.islice(found, max(args.limit, 0)))
    if args.json:
        render.emit_json([d.raw for d in shown])
        return exits.OK
    rows = [
        (
            d.delivery_id,
            d.task_id,
            d.event_type,
            d.status,
            d.attempt_count,
            d.last_status_code,
            d.last_error,
        )
        for d in shown
    ]
    columns = ("delivery", "task", "event", "status", "attempts", "last code", "last error")
    render.stdout().print(render.table(None, columns, rows))
    return exits.OK
