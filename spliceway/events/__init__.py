"""What the engine reports.

- ``log``        the event ring with sequences and live subscriptions
- ``catalogue``  every event type, when it is emitted and what its payload holds
- ``logring``    the engine's recent log lines, for ``GET /api/v1/logs``
"""
