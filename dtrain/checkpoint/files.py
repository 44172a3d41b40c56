"""Safe file primitives for checkpoints: what a path is without following it, reading only
regular files, creating only new ones, atomic writes, renames and removals that never replace
what a save did not make, fsync and sha256."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from pathlib import Path

from dtrain.errors import CheckpointError


def file_kind(path: Path) -> str | None:
    """What `path` is, without following a link or opening it: "file" (regular), "missing",
    or what it is instead ("a symbolic link", "a FIFO", ...)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISREG(mode):
        return "file"
    kinds = {
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a device",
        stat.S_ISBLK: "a device",
        stat.S_ISDIR: "a directory",
    }
    return next((k for test, k in kinds.items() if test(mode)), "not a regular file")


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file and no link: anything else in
    a checkpoint (a FIFO that would block, a device, a link leaving the folder) is refused
    before it is opened. CheckpointError names it."""
    kind = file_kind(path)
    if kind == "missing":
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is missing")
    if kind != "file":
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is {kind}, not a regular file; refused to "
            "open it"
        )
    try:  # O_NONBLOCK: a FIFO swapped in after the check still cannot block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is unreadable ({e})"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is not a regular file; refused to read it"
        )
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file (not a link) of at most `limit` bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_size > limit:
            raise CheckpointError(f"{path} is larger than {limit} bytes; refused to read it")
        return f.read(limit + 1)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(Path(path)), "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def create_new(path: Path, mode: str = "wb"):
    """A new file at `path`, opened for writing: never through a link, never over a file that
    is there already (FileExistsError names it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o644), mode)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with create_new(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if os.path.lexists(path):  # the folder is this save's own: anything there was planted
        raise FileExistsError(
            errno.EEXIST, "refused to replace a file this save did not make", path
        )
    os.replace(tmp, path)


def remove_own_dir(path: Path, quiet: bool = False) -> None:
    """Remove a folder a save left (a .partial, a .deleting, an older save of the step); a link
    or file in its place was not made by a save: refused (OSError), or left alone (`quiet`)."""
    kind = file_kind(path)
    if kind == "missing":
        return
    if kind != "a directory":
        if quiet:
            return
        raise OSError(errno.EEXIST, f"{kind} is in the way, refused to replace it", str(path))
    shutil.rmtree(path, ignore_errors=quiet)  # never follows links inside it


def rename_new(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, which must not exist: never over a file or link it did not make."""
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, "refused to replace what is there", str(dst))
    os.replace(src, dst)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def synced_hash(path: Path) -> tuple[str, int]:
    """fsync `path` (about free when its writer synced it) and return (sha256, size): the
    manifest only ever vouches for bytes that are on the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return sha256_file(path), path.stat().st_size
