"""Tasks: from an envelope to a final row, and every event on the way.

resource      statuses, the table of moves, ids, the task error, the JSON (pure)
envelope      what a caller sends (pure)
retry         when a failed attempt runs again (pure)
intake        submitting: the one home of every check and write (the use case)
admission     where a request goes and whether its payload fits; the tenant's rate
backpressure  the token bucket and the queue depth bound
submission    the row (idempotently), then the message
dispatch      publishing to Celery: the run message, the system tasks' names
execution     what a worker does to a row: claim, progress, finish, retry, expire
turns         a session's tasks one at a time, in the order accepted: take, wait, release
cancellation  cancelling (the use case)
events        the per-task event log in Redis, and the final event
eventhub      live events in the API: one pub/sub connection per process
queries       what the API reads of tasks
"""
