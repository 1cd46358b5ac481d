"""Output files of the commands (``serve --json-summary``, ``bench --json`` / ``--plot``):
refused before a run when they could not be written, written at its end with a one-line error
when writing fails after all. Every call blocks on a few file-system calls."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError, OutputWriteError

#: Pseudo file systems: opening a file there for writing may succeed (as root) and mean
#: something else than storing the output.
_PSEUDO_ROOTS = (Path("/proc"), Path("/sys"))


def check_writable_file(path: str | os.PathLike[str], setting: str) -> None:
    """Refuse now, with a ``ConfigError`` naming ``setting``, a file path that could not be
    written at the end of a run: a directory, a missing directory, a path under a file, a
    read-only file system or a pseudo one (``/proc``, ``/sys``). Opens the file to append,
    writing nothing; a file it had to create is removed again. A device or FIFO
    (``/dev/stdout``) is not opened."""
    path = Path(path)
    if path.is_symlink() and not path.exists():  # dangling: writing it creates the target
        path = path.resolve()
    given = Path(os.path.abspath(path))  # not resolved: /dev/stdout leads into /proc
    for root in _PSEUDO_ROOTS:
        if given.is_relative_to(root):
            raise ConfigError(f"{setting} {str(path)!r} is on the pseudo file system {root}, "
                              f"which does not store files; give a path on a real disk")
    if path.is_dir():
        raise ConfigError(f"{setting} {str(path)!r} is a directory; give a file path (e.g. "
                          f"{str(path / 'summary.json')!r})")
    if not path.parent.is_dir():
        problem = "is not a directory" if path.parent.exists() else "does not exist"
        raise ConfigError(f"{setting} {str(path)!r}: its directory {str(path.parent)!r} "
                          f"{problem}; create it or give another path")
    if path.exists() and not path.is_file():
        return
    created = False
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{setting} {str(path)!r} cannot be written: {exc.strerror or exc}; "
                          f"give a path in a writable directory") from None
    finally:
        if created:
            path.unlink(missing_ok=True)


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file (links and ``..`` resolved; either may not exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they lead
        return Path(a).resolve() == Path(b).resolve()


def check_distinct_files(paths: dict[str, str | os.PathLike[str] | None]) -> None:
    """Refuse, with a ``ConfigError`` naming both settings, two settings that name one file
    (``{setting: path}``; ``None``: not given): the later write would destroy the other."""
    given = [(setting, path) for setting, path in paths.items() if path is not None]
    for i, (setting_a, a) in enumerate(given):
        for setting_b, b in given[i + 1:]:
            if same_file(a, b):
                raise ConfigError(f"{setting_a} and {setting_b} both name {str(b)!r}; one would "
                                  f"overwrite the other: give each its own path")


def write_output_file(path: str | os.PathLike[str], setting: str,
                      write: Callable[[Path], object]) -> None:
    """Run ``write(path)``; an ``OSError`` (a full disk, a device that refuses) becomes an
    ``OutputWriteError`` naming ``setting`` and the path."""
    try:
        write(Path(path))
    except OSError as exc:
        raise OutputWriteError(f"{setting} {str(path)!r} could not be written: "
                               f"{exc.strerror or exc}; the run itself finished (see above): "
                               f"give a path on a disk with space next time") from None


def write_text_file(path: str | os.PathLike[str], setting: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, as :func:`write_output_file`."""
    write_output_file(path, setting, lambda p: p.write_text(text, encoding="utf-8"))
