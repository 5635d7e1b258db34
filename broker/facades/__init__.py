"""The broker as other protocols see it: A2A (and MCP) facades, their mappings pure."""
