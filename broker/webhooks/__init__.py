"""Webhooks: tell a caller about its tasks by calling its URL, signed and retried.

Two ways to subscribe: a task's own ``callback`` (signed with the tenant's callback secret)
and a tenant's subscriptions (``POST /webhooks``, each with its own secret). When a task
reaches a final state, ``fanout`` writes one delivery per interested endpoint; each delivery
is a message with a fixed ``webhook-id`` and body, attempted on the schedule until it
succeeds, fails for good, or is dead.

    events         the event types a subscriber may name (pure)
    addresses      the SSRF deny table (pure)
    ssrf           URL rules, the allow setting, resolve once and check (the Guard)
    signing        Standard Webhooks secrets and signatures (pure)
    policy         what an attempt's outcome means, and when to try again (pure)
    subscriptions  subscriptions and the callback secret (API side)
    fanout         deliveries for a task event (worker side)
    outbox         the final events whose fanout is owed (the final write records them)
    deliveries     claiming and recording attempts (worker side)
    upkeep         lost attempts, lost messages, expired bodies and deliveries (the sweep)
    delivery_log   listing deliveries and redelivering (API side)
"""
