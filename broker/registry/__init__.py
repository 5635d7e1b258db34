"""The agent registry: who serves which capability, whether it is live, and where a request
goes.

    capabilities  capability names, key patterns, the prefix chain (pure)
    model         cards, leases and their Redis keys (pure)
    leases        the worker side: advertise cards, renew, withdraw, drain and readiness flags
    routing       the live candidates of a capability and the one a request goes to
    cards         the advertised cards, as the broker reads them
    figures       what the broker measured of agents from their finished tasks
    views         agents and capabilities as the API shows them, narrowed to a key
"""
