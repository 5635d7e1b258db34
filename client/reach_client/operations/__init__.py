"""The API's operations as plans (``reach_client.plans``): one implementation each, run by
``Reach`` and ``AsyncReach`` alike."""
