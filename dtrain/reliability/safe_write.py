"""Writes that never follow a link dtrain did not make and never replace a file unless asked.

Every file dtrain writes outside its checkpoints goes through here: it is written under a
private temp folder made fresh beside its destination (mkdtemp: O_EXCL, mode 0700, so nothing
can be planted in it), then moved into place. Without `overwrite` the move is a hard link,
which fails if anything (a file, a dangling link) already holds the name; with it, a rename,
which replaces a file but never writes through a link. A symbolic link at the destination is
refused either way, in one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dtrain.errors import ConfigError


def is_link(path: str | Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def refuse_link(path: str | Path, what: str = "") -> None:
    """ConfigError if `path` is a symbolic link (dtrain makes none, so someone else did)."""
    if is_link(path):
        target = os.readlink(path)
        raise ConfigError(
            f"{what or path} is a symbolic link (to {target}); dtrain does not write through "
            "links it did not make: remove it or choose another path"
        )


def exists_message(path: str | Path, key: str = "out") -> str:
    return f"{path} already exists; pass overwrite=true to replace it, or choose another {key}="


def make_dirs(path: str | Path) -> Path:
    """mkdir -p that refuses a symbolic link at `path` itself (the folders above it are the
    user's to choose, links or not)."""
    path = Path(path)
    refuse_link(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the folder {path} ({e.strerror or e})") from None
    return path


@contextlib.contextmanager
def staged(path: str | Path, *, overwrite: bool = False, key: str = "out") -> Iterator[Path]:
    """Yields a fresh private path to write `path`'s content to; on success it is moved to
    `path`. ConfigError (one line) if `path` is a link, exists without `overwrite`, or
    cannot be written; whatever was at `path` is then unchanged."""
    path = Path(path)
    refuse_link(path)
    if not overwrite and os.path.lexists(path):
        raise ConfigError(exists_message(path, key))
    make_dirs(path.parent)
    try:
        tmp_dir = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:
        raise ConfigError(f"cannot write {path} ({e.strerror or e})") from None
    try:
        tmp = Path(tmp_dir) / path.name
        yield tmp
        if not tmp.is_file() or is_link(tmp):
            raise ConfigError(f"{path} was not written")
        _place(tmp, path, overwrite, key)
    except OSError as e:  # a full disk, a folder turned read-only mid-way
        raise ConfigError(f"cannot write {path} ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _place(tmp: Path, path: Path, overwrite: bool, key: str) -> None:
    refuse_link(path)  # again: one may have been planted while the content was written
    if overwrite:
        os.replace(tmp, path)  # replaces a file or a link itself, never a link's target
        return
    try:
        os.link(tmp, path)  # no-clobber: EEXIST if anything holds the name, links included
    except FileExistsError:
        raise ConfigError(exists_message(path, key)) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(path):  # a file system without hard links: checked, then renamed
            raise ConfigError(exists_message(path, key)) from None
        os.replace(tmp, path)


def write_bytes(path: str | Path, data: bytes, *, overwrite: bool = False, key: str = "out"):
    with staged(path, overwrite=overwrite, key=key) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str, *, overwrite: bool = False, key: str = "out"):
    write_bytes(path, text.encode(), overwrite=overwrite, key=key)


# Top-level folders a user may put on another disk with a link to a folder (a scratch volume
# for checkpoints): a run creates new files in them, and writes over none through the link.
STORAGE_LINKS = ("checkpoints", "tensorboard")
# Top-level folders a logging library fills on its own, links included (wandb's latest-run):
# dtrain writes nothing in them, so their links are the library's, not in dtrain's way.
LIBRARY_TREES = ("wandb",)


def check_tree(root: str | Path, what: str = "run dir") -> None:
    """ConfigError if any entry under `root` (itself excluded) is a symbolic link, but for a
    link to a folder at one of STORAGE_LINKS (a run writes its files there, and dtrain makes
    no links) and what lies in LIBRARY_TREES."""
    root = Path(root)
    if not root.is_dir() or is_link(root):
        return
    for dirpath, dirnames, filenames in os.walk(root):  # links to folders are not entered
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in LIBRARY_TREES or is_link(root / d)]
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if Path(dirpath) == root and name in STORAGE_LINKS and p.is_dir():
                continue
            if is_link(p):
                raise ConfigError(
                    f"{what} {root} holds a symbolic link {p} (to {os.readlink(p)}); dtrain "
                    "does not write through links it did not make: remove it or choose "
                    "another hydra.run.dir"
                )
