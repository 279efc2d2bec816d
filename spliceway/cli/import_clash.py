"""``spliceway import clash SOURCE [-o FILE] [--report [--json]]`` (docs/clash-import.md).

SOURCE is a mihomo/Clash configuration or a share-link subscription: a file, or an
``http(s)://`` URL fetched once (User-Agent ``clash.meta``, as subscription servers
expect; at most 32 MiB; 30 s). The spliceway configuration goes to FILE (YAML when it
ends in ``.yaml``/``.yml``, else JSON) or to standard output, after it validated;
inline providers' content goes beside it (``<FILE without suffix>.providers/``). The
report goes to standard error: a summary and what the user must do, every item with
``--report``, as one JSON object with ``--json``. Exit status 0 when a valid
configuration was written (even with skipped items), 1 when nothing usable came out
(or it could not be read or written).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from spliceway.clash.importer import ClashImportError, ImportResult, import_text

__all__ = ["FETCH_LIMIT", "FETCH_TIMEOUT", "cmd_import_clash", "read_source"]

EXIT_OK = 0
EXIT_FAILED = 1
#: Largest source fetched from a URL, in bytes.
FETCH_LIMIT = 32 * 1024 * 1024
#: Budget of the whole fetch of a URL source, in seconds (per socket operation).
FETCH_TIMEOUT = 30.0
_USER_AGENT = "clash.meta"


class SourceError(Exception):
    """The source could not be read (the message says why)."""


def read_source(source: str) -> tuple[bytes, str]:
    """The bytes of ``source`` and mihomo's home for it (the file's directory; the
    current directory for a URL)."""
    if source.startswith(("http://", "https://")):
        request = urllib.request.Request(source, headers={"User-Agent": _USER_AGENT})
        try:
            with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT) as response:
                body = response.read(FETCH_LIMIT + 1)
        except urllib.error.HTTPError as ex:
            raise SourceError(f"{source}: HTTP {ex.code} {ex.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as ex:
            reason = getattr(ex, "reason", ex)
            raise SourceError(f"{source}: {reason}") from None
        if len(body) > FETCH_LIMIT:
            raise SourceError(f"{source}: larger than {FETCH_LIMIT} bytes")
        return body, os.getcwd()
    path = Path(source)
    try:
        size = path.stat().st_size
        if size > FETCH_LIMIT:
            raise SourceError(f"{source}: larger than {FETCH_LIMIT} bytes")
        return path.read_bytes(), str(path.resolve().parent)
    except OSError as ex:
        raise SourceError(f"cannot read {source}: {ex.strerror or ex}") from None


def _render(config: dict[str, Any], as_yaml: bool) -> str:
    if as_yaml:
        import yaml

        # PyYAML quotes every string YAML 1.1 would read as something else ('no', 'on').
        return str(yaml.safe_dump(config, allow_unicode=True, sort_keys=False))
    return orjson.dumps(config, option=orjson.OPT_INDENT_2).decode() + "\n"


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".import-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _print_report(result: ImportResult, full: bool, as_json: bool) -> None:
    report = result.report
    if as_json:
        doc = {"source": result.source, **report.to_json(), "files": sorted(result.files)}
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode(), file=sys.stderr)
        return
    if full:
        print(report.render(), end="", file=sys.stderr)
        return
    counts = report.counts()
    print(
        f"import: {counts['converted']} converted, {counts['changed']} changed in meaning, "
        f"{counts['skipped']} skipped (--report lists them)",
        file=sys.stderr,
    )
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)


def cmd_import_clash(
    source: str, output: str | None, report: bool = False, as_json: bool = False
) -> int:
    """``spliceway import clash`` (see the module)."""
    try:
        data, home = read_source(source)
    except SourceError as ex:
        print(f"spliceway: import: {ex}", file=sys.stderr)
        return EXIT_FAILED
    if output is not None:
        files_dir = os.path.splitext(os.path.abspath(output))[0] + ".providers"
    else:
        files_dir = os.path.join(os.getcwd(), "spliceway-import.providers")
    try:
        result = import_text(data, home=home, files_dir=files_dir)
    except ClashImportError as ex:
        print(f"spliceway: import: {source}: {ex}", file=sys.stderr)
        return EXIT_FAILED
    as_yaml = output is not None and output.lower().endswith((".yaml", ".yml"))
    text = _render(result.config, as_yaml)
    try:
        for path, content in result.files.items():
            _write_atomically(path, content)
        if output is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            _write_atomically(output, text)
    except OSError as ex:
        print(f"spliceway: import: cannot write: {ex.strerror or ex}", file=sys.stderr)
        return EXIT_FAILED
    _print_report(result, report or as_json, as_json)
    return EXIT_OK
