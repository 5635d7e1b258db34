"""Remote agents: agents the broker reaches over the network (``PUT /agents/{agent_id}``).

health        when a remote agent counts as up: its checks, dampened both ways (pure)
registration  the registration's rules and rows: the agent, its cards, its secret
"""
