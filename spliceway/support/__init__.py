"""Operating-system helpers with no engine knowledge.

- ``atomic_file``  replacing a file so a crash leaves the old or the new one, whole
- ``fdlimit``      file-descriptor limits and accept backoff
- ``loop``        ``Dispatcher``: an asyncio loop in its own thread, fed from any thread
"""
