"""The engine's actors (installed as ``spliceway.actors``).

- ``dispatcher``  LoopActor: Pykka actors sharing one event-loop thread
- ``supervisor``  EngineSupervisor: listeners, sampler, routing mode
- ``listener``    ListenerActor: one inbound's listening socket
- ``flow``        FlowActor: one flow from handshake to flow.completed
- ``http_forward`` HttpForwarding: FlowActor's absolute-URI requests, a flow each
- ``http_upstream`` HttpExchange: one forwarded request's bytes up and its response down
- ``stats``       StatsSamplerActor: relay counters -> flow.updated, stats.sampled
- ``bridge``      hand-off to the C relay and completion delivery
- ``messages``    the messages actors exchange
"""
