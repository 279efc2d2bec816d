"""The JSONL sink writer against real files."""

from __future__ import annotations

import json
import os
import stat

import pytest

from spliceway.connector.jsonl import JsonlWriter


def _lines(path):
    return path.read_bytes().split(b"\n")


def test_creates_missing_parents_with_mode_0644(tmp_path):
    path = tmp_path / "a" / "b" / "events.jsonl"
    old = os.umask(0o022)
    try:
        writer = JsonlWriter(str(path))
    finally:
        os.umask(old)
    writer.close()
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_batches_append_one_document_per_line(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(str(path))
    writer.write_batch([b'{"event_id":"1"}', b'{"event_id":"2"}'])
    writer.write_batch([b'{"event_id":"3"}'])
    writer.close()
    assert path.read_bytes() == b'{"event_id":"1"}\n{"event_id":"2"}\n{"event_id":"3"}\n'


def test_reopening_appends_after_existing_content(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"a":1}\n')
    writer = JsonlWriter(str(path))
    writer.write_batch([b'{"a":2}'])
    writer.close()
    assert path.read_bytes() == b'{"a":1}\n{"a":2}\n'


def test_a_partial_last_line_from_a_crash_is_not_glued_to_the_next_batch(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"a":1}\n{"a":2,"tru')
    writer = JsonlWriter(str(path))
    writer.write_batch([b'{"a":3}', b'{"a":4}'])
    writer.write_batch([b'{"a":5}'])
    writer.close()
    lines = _lines(path)
    assert lines == [b'{"a":1}', b'{"a":2,"tru', b'{"a":3}', b'{"a":4}', b'{"a":5}', b""]
    parsed = [json.loads(line) for line in lines if line and not line.endswith(b"tru")]
    assert [d["a"] for d in parsed] == [1, 3, 4, 5]


def test_an_empty_existing_file_needs_no_leading_newline(tmp_path):
    path = tmp_path / "events.jsonl"
    path.touch()
    writer = JsonlWriter(str(path))
    writer.write_batch([b"{}"])
    writer.close()
    assert path.read_bytes() == b"{}\n"


def test_an_empty_batch_writes_nothing(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(str(path))
    writer.write_batch([])
    writer.close()
    assert path.read_bytes() == b""


def test_a_large_batch_is_written_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"event_id": str(i), "pad": "x" * 1000}).encode() for i in range(5000)]
    writer = JsonlWriter(str(path))
    writer.write_batch(lines)
    writer.close()
    assert _lines(path)[:-1] == lines


def test_write_errors_surface_as_oserror():
    # /dev/full accepts the open and fails every write with ENOSPC: a real disk-full error.
    writer = JsonlWriter("/dev/full")
    with pytest.raises(OSError, match="No space"):
        writer.write_batch([b"{}"])
    writer.close()


def test_an_unusable_path_fails_at_open(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises((FileExistsError, NotADirectoryError)):
        JsonlWriter(str(blocker / "events.jsonl"))


def test_close_is_idempotent_and_writes_after_close_fail(tmp_path):
    writer = JsonlWriter(str(tmp_path / "events.jsonl"))
    writer.close()
    writer.close()
    with pytest.raises(OSError, match="closed"):
        writer.write_batch([b"{}"])
