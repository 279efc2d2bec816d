"""The control transports stand on ``api.plane.ControlPlane`` alone: importing every one
of them loads nothing of the engine's state, its actors or the composition root."""

from __future__ import annotations

from tests.helpers.program import python_json


def test_the_transports_import_without_the_engine_its_actors_or_the_app():
    script = (
        "import json, sys\n"
        "import spliceway.api.app, spliceway.api.grpc_server, spliceway.api.ipc\n"
        "import spliceway.api.plane, spliceway.api.server\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = python_json(script)
    above = ("spliceway.app", "spliceway.engine", "spliceway.actors")
    assert "spliceway.api.app" in loaded
    assert [m for m in loaded if m.startswith(above)] == []
