"""Helpers with no engine knowledge: the operating system, and two small pure formats.

- ``atomic_file``  replacing a file so a crash leaves the old or the new one, whole
- ``fdlimit``      file-descriptor limits and accept backoff
- ``socket_mark``  the SO_MARK that keeps the engine's own sockets out of its TUN
- ``probe_url``    the ``http://`` URL a health probe sends HEAD to, parsed
- ``webhook_secret``  Standard Webhooks secrets (``whsec_``): the key inside one
- ``loop``        ``Dispatcher``: an asyncio loop in its own thread, fed from any thread
"""
