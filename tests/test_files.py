"""Atomic writes: the old file or the new one, never a part, and no temporary left behind."""

import json
import stat

import pytest

from bov_jax.files import FILE_MODE, atomic_file, check_writable, write_json_atomic


def test_a_completed_write_replaces_the_file_with_a_plain_open_mode(tmp_path):
    path = tmp_path / "status.json"
    path.write_text("old")
    write_json_atomic(path, {"step": 3})
    assert json.loads(path.read_text()) == {"step": 3}
    assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "model.npz"
    path.write_bytes(b"old bytes")
    with pytest.raises(RuntimeError, match="disk went away"), atomic_file(path) as out:
        out.write(b"half of the new")
        raise RuntimeError("disk went away")
    assert path.read_bytes() == b"old bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]


def test_check_writable_creates_the_directory_and_leaves_it_empty(tmp_path):
    target = tmp_path / "a" / "b"
    check_writable(target)
    assert target.is_dir() and not any(target.iterdir())


def test_check_writable_raises_os_error_where_no_file_can_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        check_writable(blocker / "sub")
