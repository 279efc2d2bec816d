"""The engine's actors (installed as ``spliceway.actors``).

- ``dispatcher``  LoopActor: Pykka actors sharing one event-loop thread
- ``supervisor``  EngineSupervisor: listeners, sampler, routing mode
- ``listener``    ListenerActor: one inbound's listening socket
- ``flow``        FlowActor: one flow from handshake to flow.completed
- ``flow_conn``   ConnRecording: FlowActor's record of a flow the C connection path runs
- ``flow_deps``   FlowDeps: what a flow's actor may use of the engine
- ``http_forward`` HttpForwarding: FlowActor's absolute-URI requests, a flow each
- ``http_upstream`` HttpExchange: one forwarded request's bytes up and its response down
- ``stats``       StatsSamplerActor: relay counters -> flow.updated, stats.sampled
- ``bridge``      hand-off to the C relay and completion delivery
- ``messages``    the messages actors exchange
"""
