"""What a valid document needs from the process environment: keys, secrets, credentials.

The document can be valid while its environment is not: ``spliceway validate`` reports
these problems beside the document's own, and the engine refuses to start on any of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from spliceway.config.problems import invalid
from spliceway.errors import Detail
from spliceway.support.webhook_secret import secret_key

if TYPE_CHECKING:
    from spliceway.config.models import Config
    from spliceway.config.models_api import ControlApi, Sink


def _unset_variable(name: str, field_path: str) -> Detail:
    if field_path == "api.clash.secret_env":
        remedy = (
            f'export {name}=<the secret dashboards send>, or set "secret_env": null in '
            "api.clash for a Clash API without a secret (loopback clients only)"
        )
    elif field_path == "api.control.api_key_env":
        remedy = (
            f'export {name}=<the key clients must send>, or set "api_key_env": null in '
            "api.control for a control API without a key (keep it on loopback)"
        )
    else:
        remedy = f"export {name}=<the key>, or remove this entry"
    return Detail(f"environment variable {name} is not set: {remedy}", field_path)


def control_environment_problems(
    control: ControlApi, environ: Mapping[str, str] | None = None
) -> list[Detail]:
    """The control API's key variables (``api_key_env``, ``keys[].key_env``) that are unset."""
    env = os.environ if environ is None else environ
    problems: list[Detail] = []
    if control.api_key_env is not None and not env.get(control.api_key_env):
        problems.append(_unset_variable(control.api_key_env, "api.control.api_key_env"))
    for i, key in enumerate(control.keys):
        if not env.get(key.key_env):
            problems.append(_unset_variable(key.key_env, f"api.control.keys[{i}].key_env"))
    return problems


def environment_problems(config: Config, environ: Mapping[str, str] | None = None) -> list[Detail]:
    """Every environment variable ``config`` needs at start that is unset or empty.

    The document can be valid while its environment is not: ``spliceway validate``
    reports these beside the document's own problems, and the engine refuses to start
    on any of them (the control API's keys are read only when it is enabled).
    """
    control = config.api.control
    problems = control_environment_problems(control, environ) if control.enabled else []
    clash = config.api.clash
    env = os.environ if environ is None else environ
    if clash.enabled and clash.secret_env is not None and not env.get(clash.secret_env):
        problems.append(_unset_variable(clash.secret_env, "api.clash.secret_env"))
    return problems + sink_environment_problems(config.api.event_sinks, environ)


def sink_environment_problems(
    sinks: Sequence[Sink], environ: Mapping[str, str] | None = None
) -> list[Detail]:
    """The sinks' secret and credential variables that are unset or unusable."""
    return [
        p for i, sink in enumerate(sinks) for p in one_sink_environment_problems(i, sink, environ)
    ]


def one_sink_environment_problems(
    index: int, sink: Sink, environ: Mapping[str, str] | None = None
) -> list[Detail]:
    """:func:`sink_environment_problems` of ``api.event_sinks[index]``."""
    env = os.environ if environ is None else environ
    problems: list[Detail] = []
    for field in ("secret_env", "credentials_env"):
        name = getattr(sink, field, None)
        if name is None:
            continue
        where = f"api.event_sinks[{index}].{field}"
        value = env.get(name)
        if not value:
            problems.append(_unset_variable(name, where))
        elif field == "secret_env":
            try:
                secret_key(value)
            except ValueError as ex:
                problems.append(Detail(f"environment variable {name} {ex}", where))
    return problems


def check_environment(config: Config, environ: Mapping[str, str] | None = None) -> None:
    """Raise ``invalid_argument`` listing every problem :func:`environment_problems` finds."""
    check_environment_details(environment_problems(config, environ))


def check_environment_details(problems: list[Detail]) -> None:
    """Raise ``invalid_argument`` (field path of the first) when ``problems`` is not empty."""
    if problems:
        message = (
            problems[0].message
            if len(problems) == 1
            else f"{len(problems)} environment variables the configuration names are not set"
        )
        error = invalid(problems, message)
        error.field_path = problems[0].field_path
        raise error


def default_ipc_path(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/spliceway/control.sock``, else ``/tmp/spliceway-<uid>/control.sock``."""
    env = os.environ if environ is None else environ
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "spliceway", "control.sock")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"/tmp/spliceway-{uid}/control.sock"
