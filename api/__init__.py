"""The HTTP face of Agent-Reach: a thin FastAPI app over ``broker``."""
