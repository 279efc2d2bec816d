"""The control transports stand on ``api.plane.ControlPlane`` alone: importing every one
of them loads nothing of the engine's state, its actors or the composition root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_transports_import_without_the_engine_its_actors_or_the_app():
    script = (
        "import json, sys\n"
        "import spliceway.api.app, spliceway.api.grpc_server, spliceway.api.ipc\n"
        "import spliceway.api.plane, spliceway.api.server\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    above = ("spliceway.app", "spliceway.engine", "spliceway.actors")
    assert "spliceway.api.app" in loaded
    assert [m for m in loaded if m.startswith(above)] == []
