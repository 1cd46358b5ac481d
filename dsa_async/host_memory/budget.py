"""The real host-memory budget: how many bytes a new host pool may take on this machine.

    available = min(MemAvailable,
                    headroom of the process's cgroup and of every ancestor up to the mount root
                        (v2: memory.max - (memory.current - inactive_file),
                         v1: memory.limit_in_bytes - (memory.usage_in_bytes - total_inactive_file)),
                    free hugepages (HugePages_Free x Hugepagesize) when the arena is hugepage-backed)
                - reserve  (default min(1 GiB, 5 % of the tightest limit))

The working set leaves out inactive file cache, which the kernel reclaims before it fails an
allocation. A parent cgroup tighter than the child wins, because the kernel charges every level.
RLIMIT_MEMLOCK is reported but never caps the budget: the CUDA driver page-locks memory for
``cudaHostRegister``/``cudaHostAlloc`` through its own kernel path, not ``mlock(2)``.

On cgroup v1 with swap accounting, memory + swap is charged too: ``memory.memsw.*`` is reported
separately and caps the headroom when its own headroom is lower; the memory limit stays
``memory.limit_in_bytes``.

Every file is read below an injectable root (argument, else ``$DSA_ASYNC_ROOT``, else ``/``), so
tests feed fake ``proc/`` and ``sys/fs/cgroup/`` trees. A probe is a handful of small blocking
file reads (well under a millisecond); it takes no locks.

Files that cannot be used, the same way for every file: a file that does not exist (or under a
path component that is not a directory) means what its absence means: no ``/proc/meminfo`` is a
``ConfigError``, no mountinfo means the standard mountpoints, no ``/proc/self/cgroup``, no usage
file or no file that could hold a limit means no cgroup limit known there (v2 reads
``memory.high`` also where ``memory.max`` is missing), no ``memory.stat`` means no inactive file
cache, no ``memory.high`` or ``memory.memsw.*`` means none. A file that exists but cannot be read
(permissions, a symlink loop, a directory, an I/O error), or a figure the probe needs that is not
a plain ASCII number (or the file's word for no limit: ``max``), is a ``ConfigError`` naming the
file and what it holds: it may hold a limit, and the probe refuses to guess a budget.
"""

from __future__ import annotations

import enum
import os
import re
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, shown
from ..geometry import as_flag

ROOT_ENV = "DSA_ASYNC_ROOT"
GIB_BYTES = 1 << 30
DEFAULT_RESERVE_CAP_BYTES = GIB_BYTES
DEFAULT_RESERVE_PERCENT = 5
#: cgroup v1 writes "no limit" as a page-rounded LONG_MAX; anything this large means no limit.
V1_UNLIMITED_FLOOR_BYTES = 1 << 62


class CgroupVersion(enum.Enum):
    V1 = "v1"
    V2 = "v2"


class BudgetLimiter(enum.Enum):
    """Which figure sets ``available_bytes``."""

    MEM_AVAILABLE = "mem_available"
    CGROUP = "cgroup"
    HUGEPAGES = "hugepages"


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup on the path from the process's cgroup to the hierarchy's root.

    ``limit_bytes`` and ``headroom_bytes`` are ``None`` when the level sets no limit.
    """

    path: str  #: the cgroup path as ``/proc/self/cgroup`` names it, e.g. ``/docker/abc``
    version: CgroupVersion
    directory: str  #: where its files were read
    limit_bytes: int | None
    usage_bytes: int
    inactive_file_bytes: int
    working_set_bytes: int
    headroom_bytes: int | None
    #: the file whose headroom binds: memory.max or memory.high (v2); memory.limit_in_bytes or
    #: memory.memsw.limit_in_bytes (v1, memory + swap)
    limit_file: str = ""
    #: v1 with swap accounting: the memory + swap limit (None: unlimited or no accounting) and
    #: usage (None: no accounting). Not the memory limit; it caps ``headroom_bytes`` when lower.
    memsw_limit_bytes: int | None = None
    memsw_usage_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.limit_file:
            object.__setattr__(self, "limit_file", _FILES[self.version][0])

    @property
    def memory_limit_file(self) -> str:
        """The file ``limit_bytes`` comes from (memory + swap is never the memory limit)."""
        return _FILES[self.version][0] if self.limit_file == MEMSW_LIMIT_FILE else self.limit_file

    @property
    def memsw_working_set_bytes(self) -> int | None:
        """v1 with swap accounting: memory + swap usage - inactive file; else ``None``."""
        if self.memsw_usage_bytes is None:
            return None
        return _working_set(self.memsw_usage_bytes, self.inactive_file_bytes)


def _working_set(usage_bytes: int, inactive_file_bytes: int) -> int:
    """What reclaim cannot take back: usage minus the inactive file cache."""
    return max(0, usage_bytes - inactive_file_bytes)


@dataclass(frozen=True)
class BudgetSnapshot:
    """The host-memory budget at one instant. ``available_bytes`` does not yet subtract the
    ledger's reservations of other pools and processes; see ``plan.plan_pools``."""

    root: str
    mem_total_bytes: int
    mem_available_bytes: int
    levels: tuple[CgroupLevel, ...]
    hugepages: bool  #: whether the arena is hugepage-backed (then free hugepages cap the budget)
    hugepages_free_bytes: int | None  #: None when meminfo has no hugepage lines
    memlock_limit_bytes: int | None  #: RLIMIT_MEMLOCK soft limit, None = unlimited; info only
    reserve_bytes: int
    limit_bytes: int  #: the tightest limit: min(MemTotal, every cgroup limit)
    available_before_reserve_bytes: int
    available_bytes: int
    limiter: BudgetLimiter
    limiter_cgroup_path: str | None  #: set when ``limiter`` is CGROUP
    limiter_level: CgroupLevel | None  #: the limiting cgroup level, when ``limiter`` is CGROUP


def check_probe_arguments(root: object, reserve_bytes: object, hugepages: object) -> bool:
    """Raise ``ConfigError`` for arguments ``probe_host_budget`` cannot use (before it, or a
    caller that takes a lock for it, does anything); return ``hugepages`` as a bool."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"root must be a directory path (str or os.PathLike) or None, got "
                          f"{shown(root)}")
    if reserve_bytes is not None and (
        isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0
    ):
        raise ConfigError(f"reserve_bytes must be an int >= 0, got {shown(reserve_bytes)}")
    return as_flag("hugepages", hugepages)


def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The probe root: ``root``, else ``$DSA_ASYNC_ROOT``, else ``/``."""
    if root is None:
        root = os.environ.get(ROOT_ENV) or "/"
    return Path(root)


def read_memlock_limit_bytes() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes; ``None`` when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _under(root: Path, absolute: str) -> Path:
    return root / absolute.lstrip("/")


def _read_text(path: Path) -> str | None:
    """The file's text; ``None`` when it does not exist. Any other ``OSError`` is a
    ``ConfigError`` (see the module docstring)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}; the host-memory budget will not guess "
            f"a limit it cannot read: make the file readable, or point ${ROOT_ENV} at another tree"
        ) from None


def _ascii_int(text: str) -> int | None:
    """``text`` as an int when it is ASCII digits only, else ``None`` (``str.isdigit()`` and
    ``int()`` take other scripts' digits too, and do not agree on which)."""
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def _figure(where: str, text: str, *, unlimited_word: str | None = None) -> int | None:
    """A file's figure in bytes, or ``None`` for ``unlimited_word``; anything else is a
    ``ConfigError`` naming ``where`` and the text."""
    text = text.strip()
    if unlimited_word is not None and text == unlimited_word:
        return None
    value = _ascii_int(text)
    if value is None:
        also = f" or {unlimited_word!r}" if unlimited_word else ""
        raise ConfigError(
            f"{where} holds {shown(text)}, not a number of bytes{also}; the host-memory budget will not "
            f"guess a limit: fix the file, or point ${ROOT_ENV} at another tree"
        )
    return value


_MEMINFO_KEYS = ("MemTotal", "MemAvailable", "HugePages_Free", "HugePages_Rsvd", "Hugepagesize")


def _read_meminfo(root: Path) -> dict[str, int]:
    """meminfo as bytes (``kB`` lines) or counts (``HugePages_*``)."""
    path = _under(root, "/proc/meminfo")
    text = _read_text(path)
    if text is None:
        raise ConfigError(
            f"cannot read {path}: the host-memory budget needs /proc/meminfo under the probe "
            f"root {str(root)!r}; unset ${ROOT_ENV} or point it at a tree that has proc/meminfo"
        )
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        key, rest = key.strip(), rest.strip()
        if key in _MEMINFO_KEYS:  # other lines may hold anything
            kib = rest.endswith("kB")
            number = _figure(f"{path} line {key!r}", rest[:-2] if kib else rest)
            assert number is not None
            values[key] = number * (1024 if kib else 1)
    for key in ("MemTotal", "MemAvailable"):
        if key not in values:
            raise ConfigError(f"{path} has no {key} line (kernel older than 3.14, or not meminfo)")
    return values


# --- cgroup discovery --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    root: str  #: the cgroup path mounted at ``mountpoint``
    mountpoint: str
    version: CgroupVersion


def _unescape_mount_field(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo`` octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _read_memory_mounts(root: Path) -> list[_Mount] | None:
    """cgroup2 mounts and v1 mounts of the memory controller; ``None`` when mountinfo is missing."""
    text = _read_text(_under(root, "/proc/self/mountinfo"))
    if text is None:
        return None
    mounts = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 1:
            continue
        fstype, super_options = tail[0], (tail[2] if len(tail) > 2 else "")
        if fstype == "cgroup2":
            version = CgroupVersion.V2
        elif fstype == "cgroup" and "memory" in super_options.split(","):
            version = CgroupVersion.V1
        else:
            continue
        mount_root, mountpoint = (_unescape_mount_field(f) for f in fields[3:5])
        mounts.append(_Mount(mount_root, mountpoint, version))
    return mounts


_DEFAULT_MOUNTS = (  # where systemd and Docker mount them, for trees without mountinfo
    _Mount("/", "/sys/fs/cgroup", CgroupVersion.V2),
    _Mount("/", "/sys/fs/cgroup/memory", CgroupVersion.V1),
)


def _read_process_cgroups(root: Path) -> dict[CgroupVersion, str]:
    """The process's cgroup path in the v2 hierarchy and in the v1 memory hierarchy."""
    text = _read_text(_under(root, "/proc/self/cgroup"))
    paths: dict[CgroupVersion, str] = {}
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths[CgroupVersion.V2] = path
        elif "memory" in controllers.split(","):
            paths[CgroupVersion.V1] = path
    return paths


def _is_under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/")
    return path == prefix or path.startswith(prefix + "/") or prefix == ""


def _level_paths(cgroup_path: str, mount: _Mount) -> list[tuple[str, str]]:
    """(cgroup path, mount-relative path) from the process's cgroup up to the mount root."""
    if _is_under(cgroup_path, mount.root):
        relative = cgroup_path[len(mount.root.rstrip("/")) :].strip("/")
    else:
        relative = ""  # a cgroup outside what this mount shows: only the mount root is visible
    parts = [p for p in relative.split("/") if p]
    base = mount.root.rstrip("/")
    out = []
    for depth in range(len(parts), -1, -1):
        rel = "/".join(parts[:depth])
        out.append(((base + "/" + rel).rstrip("/") or "/", rel))
    return out


# --- one level's figures -----------------------------------------------------------------------


def _read_stat_key(path: Path, keys: tuple[str, ...]) -> int:
    """The first of ``keys`` that ``path`` (memory.stat) has; 0 when none (or no file)."""
    stat = {}
    for line in (_read_text(path) or "").splitlines():
        key, _, value = line.strip().partition(" ")
        if key in keys:  # other lines may hold anything
            stat[key] = _figure(f"{path} line {key!r}", value)
    return next((stat[k] for k in keys if k in stat), 0)


#: v1 with swap accounting: the memory + swap limit (its usage: memory.memsw.usage_in_bytes)
MEMSW_LIMIT_FILE = "memory.memsw.limit_in_bytes"

_FILES = {
    CgroupVersion.V2: ("memory.max", "memory.current", ("inactive_file",)),
    CgroupVersion.V1: (
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        ("total_inactive_file", "inactive_file"),  # total_*: the whole subtree, like usage
    ),
}


def _read_level(directory: Path, path: str, version: CgroupVersion) -> CgroupLevel | None:
    """One level's figures; ``None`` when its usage file is missing, or every file that could
    hold its limit (v2: ``memory.max`` and ``memory.high``)."""
    limit_name, usage_name, inactive_keys = _FILES[version]
    limit_text = _read_text(directory / limit_name)
    usage_text = _read_text(directory / usage_name)
    v2 = version is CgroupVersion.V2
    high_text = _read_text(directory / "memory.high") if v2 else None
    if usage_text is None or (limit_text is None and high_text is None):
        return None
    limit_bytes = None if limit_text is None else _figure(
        str(directory / limit_name), limit_text, unlimited_word="max" if v2 else None)
    if not v2 and limit_bytes is not None and limit_bytes >= V1_UNLIMITED_FLOOR_BYTES:
        limit_bytes = None
    usage_bytes = _figure(str(directory / usage_name), usage_text)
    assert usage_bytes is not None
    inactive_file_bytes = _read_stat_key(directory / "memory.stat", inactive_keys)
    working_set_bytes = _working_set(usage_bytes, inactive_file_bytes)
    headroom_bytes = None if limit_bytes is None else max(0, limit_bytes - working_set_bytes)
    limit_file = limit_name
    memsw_limit_bytes = memsw_usage_bytes = None
    if v2:
        # Above memory.high the kernel throttles and reclaims hard: a page-locked or
        # zero-filled arena cannot be reclaimed, so the high mark is a limit too (also where
        # memory.max is missing).
        high_bytes = (None if high_text is None else
                      _figure(str(directory / "memory.high"), high_text, unlimited_word="max"))
        if high_bytes is not None and (limit_bytes is None or high_bytes < limit_bytes):
            limit_bytes, limit_file = high_bytes, "memory.high"
            headroom_bytes = max(0, limit_bytes - working_set_bytes)
    else:
        # With swap accounting, memory + swap is charged too: swapping out lowers no charge,
        # so its headroom caps a new arena as well. It is not the memory limit.
        sw_limit_text = _read_text(directory / MEMSW_LIMIT_FILE)
        sw_usage_text = _read_text(directory / "memory.memsw.usage_in_bytes")
        if sw_limit_text is not None and sw_usage_text is not None:
            memsw_limit_bytes = _figure(str(directory / MEMSW_LIMIT_FILE), sw_limit_text)
            memsw_usage_bytes = _figure(str(directory / "memory.memsw.usage_in_bytes"),
                                        sw_usage_text)
            assert memsw_limit_bytes is not None and memsw_usage_bytes is not None
            if memsw_limit_bytes >= V1_UNLIMITED_FLOOR_BYTES:
                memsw_limit_bytes = None
            else:
                sw_headroom = max(0, memsw_limit_bytes
                                  - _working_set(memsw_usage_bytes, inactive_file_bytes))
                if headroom_bytes is None or sw_headroom < headroom_bytes:
                    headroom_bytes, limit_file = sw_headroom, MEMSW_LIMIT_FILE
    return CgroupLevel(
        path=path,
        version=version,
        directory=str(directory),
        limit_bytes=limit_bytes,
        usage_bytes=usage_bytes,
        inactive_file_bytes=inactive_file_bytes,
        working_set_bytes=working_set_bytes,
        headroom_bytes=headroom_bytes,
        limit_file=limit_file,
        memsw_limit_bytes=memsw_limit_bytes,
        memsw_usage_bytes=memsw_usage_bytes,
    )


def read_cgroup_levels(root: str | os.PathLike[str] | None = None) -> tuple[CgroupLevel, ...]:
    """Every cgroup level that constrains this process, leaf first, per hierarchy (v2, then v1).

    Levels whose files are missing are skipped. Blocking: small file reads.
    """
    base = resolve_root(root)
    cgroup_paths = _read_process_cgroups(base)
    mounts = _read_memory_mounts(base)
    if mounts is None:
        mounts = list(_DEFAULT_MOUNTS)
    levels: list[CgroupLevel] = []
    for version in (CgroupVersion.V2, CgroupVersion.V1):
        cgroup_path = cgroup_paths.get(version)
        candidates = [m for m in mounts if m.version is version]
        if cgroup_path is None or not candidates:
            continue
        # A mount whose root contains the process's cgroup shows it and the levels up to that
        # root: the shallowest such root shows the most ancestors (a bind of a subtree besides
        # the full hierarchy must not hide the limits above it). Without one, the deepest
        # root is the closest view there is.
        containing = [m for m in candidates if _is_under(cgroup_path, m.root)]
        mount = (min(containing, key=lambda m: len(m.root.rstrip("/"))) if containing
                 else max(candidates, key=lambda m: len(m.root)))
        for path, rel in _level_paths(cgroup_path, mount):
            level = _read_level(_under(base, mount.mountpoint) / rel, path, version)
            if level is not None:
                levels.append(level)
    return tuple(levels)


# --- the probe ---------------------------------------------------------------------------------


def default_reserve_bytes(limit_bytes: int) -> int:
    """min(1 GiB, 5 % of the tightest limit)."""
    return min(DEFAULT_RESERVE_CAP_BYTES, limit_bytes * DEFAULT_RESERVE_PERCENT // 100)


def probe_host_budget(
    root: str | os.PathLike[str] | None = None,
    *,
    reserve_bytes: int | None = None,
    hugepages: bool = False,
    read_memlock: Callable[[], int | None] = read_memlock_limit_bytes,
) -> BudgetSnapshot:
    """Read the host-memory budget now. Blocking (a few small file reads; cheap).

    ``reserve_bytes`` overrides the default reserve; ``hugepages`` says the arena is
    hugepage-backed, so free hugepages cap the budget too.
    """
    hugepages = check_probe_arguments(root, reserve_bytes, hugepages)
    base = resolve_root(root)
    meminfo = _read_meminfo(base)
    levels = read_cgroup_levels(base)
    mem_total_bytes, mem_available_bytes = meminfo["MemTotal"], meminfo["MemAvailable"]
    hugepages_free_bytes = (  # reserved ones are promised to existing mappings already
        max(0, meminfo["HugePages_Free"] - meminfo.get("HugePages_Rsvd", 0))
        * meminfo["Hugepagesize"]
        if "HugePages_Free" in meminfo and "Hugepagesize" in meminfo
        else None
    )
    if hugepages and hugepages_free_bytes is None:
        raise ConfigError(
            f"the arena is hugepage-backed but {_under(base, '/proc/meminfo')} has no "
            f"HugePages_Free/Hugepagesize lines; turn hugepages off"
        )

    candidates: list[tuple[int, BudgetLimiter, CgroupLevel | None]] = [
        (mem_available_bytes, BudgetLimiter.MEM_AVAILABLE, None)
    ]
    candidates += [
        (lvl.headroom_bytes, BudgetLimiter.CGROUP, lvl)
        for lvl in levels
        if lvl.headroom_bytes is not None
    ]
    if hugepages:
        assert hugepages_free_bytes is not None
        candidates.append((hugepages_free_bytes, BudgetLimiter.HUGEPAGES, None))
    # min() keeps the first of equal figures: MemAvailable, then leaf-most cgroup, then hugepages.
    available_before_reserve_bytes, limiter, limiter_level = min(candidates, key=lambda c: c[0])

    cgroup_limits = [lvl.limit_bytes for lvl in levels if lvl.limit_bytes is not None]
    limit_bytes = min([mem_total_bytes, *cgroup_limits])
    if reserve_bytes is None:
        reserve_bytes = default_reserve_bytes(limit_bytes)
    return BudgetSnapshot(
        root=str(base),
        mem_total_bytes=mem_total_bytes,
        mem_available_bytes=mem_available_bytes,
        levels=levels,
        hugepages=hugepages,
        hugepages_free_bytes=hugepages_free_bytes,
        memlock_limit_bytes=read_memlock(),
        reserve_bytes=reserve_bytes,
        limit_bytes=limit_bytes,
        available_before_reserve_bytes=available_before_reserve_bytes,
        available_bytes=max(0, available_before_reserve_bytes - reserve_bytes),
        limiter=limiter,
        limiter_cgroup_path=None if limiter_level is None else limiter_level.path,
        limiter_level=limiter_level,
    )
