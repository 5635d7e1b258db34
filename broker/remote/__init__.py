"""Remote agents: agents the broker reaches over the network (``PUT /agents/{agent_id}``).

a2a_card      an A2A agent's card: fetched, read, its skills made our cards
a2a_json      A2A's protobuf messages as the JSON of a task's output and result (pure)
connections   connections only to addresses agents may reach: aiohttp, and httpx over it
health        when a remote agent counts as up: its checks, dampened both ways (pure)
registration  the registration's rules and rows: the agent, its cards, its secret
"""
