"""The wire shapes: every document the engine puts on the wire, declared once.

- ``schema``  how a shape is declared (TypedDict + ``Field``), and what is generated
  from one: the OpenAPI components and the catalogue tables of docs/events.md
- ``flow``    the FlowRecord (``FlowState.render``'s output) and its parts
- ``event``   the event envelope (the proto's ``message Event``)
- ``stats``   the stats resource and ``stats.sampled`` payload, the UDP counters
- ``sink``    one event sink's status (``GET /api/v1/sinks``)

Pure declarations: this package imports nothing of the engine, so everything
above it (records, the event log, the catalogue, the API) may use it.
"""
