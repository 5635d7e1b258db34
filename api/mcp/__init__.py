"""Agent-Reach as an MCP server at ``/mcp``: streamable HTTP, stateless, the API's bearer keys.

- ``tools/list``: a tool per capability the key may run, named as the capability, with the
  description and input schema of the card advertised last for it; plus ``reach_get_task``
  and ``reach_cancel_task`` (``tools``).
- ``tools/call`` on a capability submits a task and waits up to ``mcp_wait_s``: its result
  as structured content, its error with ``isError``, or, still running, ``{"task_id",
  "status"}`` to poll with ``reach_get_task``. Progress events become progress notifications
  when the call carries a progress token (``calls``).
- The route, its authentication and the SDK's session manager: ``route``.
"""

from api.mcp.route import McpFacade

__all__ = ["McpFacade"]
