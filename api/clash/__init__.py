"""The Clash-compatible API: mihomo's external controller over a running engine.

Dashboards (zashboard, metacubexd, Yacd) and Clash controller clients speak this
API; spliceway answers it on its own listener (``api.clash``), beside the control
API, by mapping its outbounds, groups, flows, rules and events onto mihomo's
shapes (docs/clash-api.md). Every action goes through the engine's one command
table, so a dashboard's selector switch is the same ``policies.select`` as an HTTP,
IPC, CLI or gRPC caller's, with the same events.

Modules: :mod:`.context` (what every route reads), :mod:`.guard` (CORS, secret,
browser protection, body limits), :mod:`.mapping` (spliceway shapes to mihomo's,
pure), :mod:`.routes` (the plain HTTP routes), :mod:`.streams` (``/traffic``,
``/memory``, ``/logs`` and ``/connections`` as WebSocket or chunked HTTP),
:mod:`.static` (``external_ui`` at ``/ui/``), :mod:`.storage` (``/storage/{key}``),
:mod:`.app` (the Starlette app) and :mod:`.server` (uvicorn on its own thread).
"""
