"""Atomic writes and output checks, on real files: a failing write leaves the old file byte for byte."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pipefold.errors import ConfigError
from pipefold.files import atomic, check_writable, write_bytes, write_json, write_text

SRC = Path(__file__).resolve().parents[1] / "src"


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".pipefold-"))


def test_a_write_that_fails_midway_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "keep.json"
    target.write_bytes(b'{"valid": true}\n')
    before = target.read_bytes()
    with pytest.raises(RuntimeError, match="serializer"), atomic(target) as fh:
        fh.write('{"half": ')
        fh.flush()
        raise RuntimeError("the serializer broke")
    assert target.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_a_serializer_that_raises_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "keep.json"
    write_json(target, {"a": [1, 2]})
    before = target.read_bytes()
    with pytest.raises(TypeError):
        write_json(target, {"a": object()})  # json cannot encode it
    assert target.read_bytes() == before and _leftovers(tmp_path) == []


def test_new_and_replaced_files_get_the_permissions_open_would(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    with open(plain, "w", encoding="utf-8") as fh:  # the reference: what open() gives a new file under this umask
        fh.write("x")
    fresh = tmp_path / "fresh.txt"
    write_text(fresh, "y")
    assert fresh.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    private = tmp_path / "private.bin"
    private.write_bytes(b"old")
    private.chmod(0o600)
    write_bytes(private, b"new")
    assert private.read_bytes() == b"new" and private.stat().st_mode & 0o777 == 0o600


def test_a_symbolic_link_is_written_through(tmp_path: Path) -> None:
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


@pytest.mark.parametrize(
    ("path", "figure", "expected"),
    [
        ("{tmp}", False, "is a directory"),
        ("{tmp}/missing/out.json", False, "does not exist"),
        ("/proc/pipefold-out.json", False, "cannot write the output file /proc/pipefold-out.json"),
        ("{tmp}/out.pdf", True, "ending in .png or .svg"),
        ("", False, "empty"),
    ],
)
def test_check_writable_refuses_before_any_work(tmp_path: Path, path: str, figure: bool, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_writable(path.format(tmp=tmp_path), figure=figure)
    assert _leftovers(tmp_path) == []


def _limited(limit: int) -> None:
    # A file may grow to `limit` bytes, no more: a write beyond it fails (EFBIG) as on a full disk. Python
    # ignores SIGXFSZ, so the write returns the error instead of killing the process.
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize(
    ("argv", "name", "valid"),
    [
        (["generate", "zb-h1", "-p", "8", "-m", "64", "-o", "{out}"], "keep.json", b'{"small": 1}\n'),
        (["simulate", "zb-h1", "-p", "4", "-m", "8", "--plot", "{out}"], "keep.png", b"\x89PNG\r\n\x1a\nold"),
        (["simulate", "zb-h1", "-p", "8", "-m", "64", "--trace", "{out}"], "trace.json", b'{"traceEvents": []}\n'),
    ],
)
def test_a_full_disk_keeps_the_old_file(tmp_path: Path, argv: list[str], name: str, valid: bytes) -> None:
    out = tmp_path / name
    out.write_bytes(valid)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pipefold", *(a.format(out=out) for a in argv)], env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=lambda: _limited(4096))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"pipefold {argv[0]}: error: cannot write {out}: File too large"
    assert out.read_bytes() == valid  # byte for byte
    assert _leftovers(tmp_path) == []
    # Without the limit the same command replaces it with a whole file.
    proc = subprocess.run([sys.executable, "-m", "pipefold", *(a.format(out=out) for a in argv)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_bytes()) > 4096 and _leftovers(tmp_path) == []


WRITES = re.compile(r"""open\([^)]*["'][wax]b?\+?["']|\.savefig\(|\.write_text\(|\.write_bytes\(|json\.dump\(""")


def test_every_file_the_library_writes_goes_through_files() -> None:
    """Writes outside pipefold.files would not be atomic. The ranks' result pickles in the launcher's private
    temporary folder (read only after the rank exits) are an exception, and so is torchrun's error file, which
    torchrun names and reads after the worker exits."""
    allowed = {"files.py", "runtime/launch/local.py", "runtime/launch/elastic.py"}
    found = []
    for path in sorted((SRC / "pipefold").rglob("*.py")):
        rel = path.relative_to(SRC / "pipefold").as_posix()
        if rel in allowed:
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if WRITES.search(line):
                found.append(f"{rel}:{lineno}: {line.strip()}")
    assert found == []
