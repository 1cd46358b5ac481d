"""Builders of fake ``/proc`` and ``/sys/fs/cgroup`` trees for the budget probe and the ledger.

Each builder writes under a root directory that the probe reads through its ``root`` argument
(or ``$DSA_ASYNC_ROOT``), so every figure a test expects is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
V1_UNLIMITED = 9223372036854771712  # LONG_MAX rounded down to a 4 KiB page, as cgroup v1 writes it


@dataclass(frozen=True)
class Level:
    """One cgroup's memory files. ``limit_bytes=None`` writes "max" (v2) or the v1 unlimited."""

    limit_bytes: int | None
    usage_bytes: int
    inactive_file_bytes: int = 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_meminfo(
    root: Path,
    *,
    mem_total_bytes: int,
    mem_available_bytes: int,
    hugepages_total: int = 0,
    hugepages_free: int = 0,
    hugepages_reserved: int = 0,
    hugepage_size_bytes: int = 2 * MIB,
) -> None:
    """``proc/meminfo`` in the kernel's format (kB values, hugepage counts)."""
    assert mem_total_bytes % KIB == 0 and mem_available_bytes % KIB == 0
    _write(
        root / "proc/meminfo",
        f"MemTotal:       {mem_total_bytes // KIB} kB\n"
        f"MemFree:        {mem_available_bytes // KIB // 2} kB\n"
        f"MemAvailable:   {mem_available_bytes // KIB} kB\n"
        f"Buffers:          1024 kB\n"
        f"Cached:          65536 kB\n"
        f"AnonHugePages:       0 kB\n"
        f"HugePages_Total:    {hugepages_total}\n"
        f"HugePages_Free:     {hugepages_free}\n"
        f"HugePages_Rsvd:     {hugepages_reserved}\n"
        f"HugePages_Surp:        0\n"
        f"Hugepagesize:       {hugepage_size_bytes // KIB} kB\n"
        f"Hugetlb:               0 kB\n",
    )


def _mountinfo_line(mount_id: int, root: str, mountpoint: str, fstype: str, options: str) -> str:
    return (
        f"{mount_id} 23 0:{mount_id} {root} {mountpoint} rw,nosuid,nodev,noexec,relatime "
        f"- {fstype} {fstype} {options}\n"
    )


def _levels_in_order(cgroup_path: str, levels: dict[str, Level]) -> None:
    for path in levels:
        assert cgroup_path == path or cgroup_path.startswith(path.rstrip("/") + "/"), (path, cgroup_path)


def write_cgroup_v2(
    root: Path,
    cgroup_path: str,
    levels: dict[str, Level],
    *,
    mount_root: str = "/",
    mountinfo: bool = True,
) -> None:
    """A unified (v2) hierarchy at ``sys/fs/cgroup`` with the process in ``cgroup_path``.

    ``levels`` maps cgroup paths (the process's and its ancestors) to their files; the root
    cgroup, as in the kernel, has no ``memory.max``.
    """
    _levels_in_order(cgroup_path, levels)
    _write(root / "proc/self/cgroup", f"0::{cgroup_path}\n")
    if mountinfo:
        _write(
            root / "proc/self/mountinfo",
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
            + _mountinfo_line(30, mount_root, "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate"),
        )
    base = root / "sys/fs/cgroup"
    _write(base / "cgroup.controllers", "cpu io memory pids\n")
    for path, level in levels.items():
        rel = path[len(mount_root.rstrip("/")) :].strip("/")
        directory = base / rel
        _write(
            directory / "memory.max", "max\n" if level.limit_bytes is None else f"{level.limit_bytes}\n"
        )
        _write(directory / "memory.current", f"{level.usage_bytes}\n")
        _write(
            directory / "memory.stat",
            f"anon 4096\nfile 8192\ninactive_file {level.inactive_file_bytes}\nactive_file 0\n",
        )


def write_cgroup_v1(
    root: Path,
    cgroup_path: str,
    levels: dict[str, Level],
    *,
    mount_root: str = "/",
    mountinfo: bool = True,
) -> None:
    """A v1 memory hierarchy at ``sys/fs/cgroup/memory`` with the process in ``cgroup_path``."""
    _levels_in_order(cgroup_path, levels)
    _write(
        root / "proc/self/cgroup",
        f"12:pids:/\n11:cpu,cpuacct:{cgroup_path}\n4:memory:{cgroup_path}\n1:name=systemd:/\n0::/\n",
    )
    if mountinfo:
        _write(
            root / "proc/self/mountinfo",
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
            + _mountinfo_line(30, "/", "/sys/fs/cgroup", "tmpfs", "rw,mode=755")
            + _mountinfo_line(31, "/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")
            + _mountinfo_line(32, mount_root, "/sys/fs/cgroup/memory", "cgroup", "rw,memory")
            + _mountinfo_line(33, "/", "/sys/fs/cgroup/unified", "cgroup2", "rw"),
        )
    base = root / "sys/fs/cgroup/memory"
    for path, level in levels.items():
        rel = path[len(mount_root.rstrip("/")) :].strip("/")
        directory = base / rel
        limit = V1_UNLIMITED if level.limit_bytes is None else level.limit_bytes
        _write(directory / "memory.limit_in_bytes", f"{limit}\n")
        _write(directory / "memory.usage_in_bytes", f"{level.usage_bytes}\n")
        _write(
            directory / "memory.stat",
            f"cache 8192\nrss 4096\ninactive_file 1\nactive_file 0\n"
            f"total_cache 8192\ntotal_rss 4096\ntotal_inactive_file {level.inactive_file_bytes}\n",
        )


def write_proc_stat(
    root: Path, pid: int, start_time_ticks: int, *, comm: str = "python3", state: str = "S"
) -> None:
    """``proc/<pid>/stat`` with the start time in field 22; ``comm`` may hold spaces and ')'."""
    fields = (
        [state, "1", str(pid), str(pid), "0", "-1", "4194560"]
        + ["0"] * 12
        + [str(start_time_ticks)]
        + ["0"] * 30
    )
    assert fields[19] == str(start_time_ticks)  # fields[0] is field 3, so field 22 is fields[19]
    _write(root / "proc" / str(pid) / "stat", f"{pid} ({comm}) {' '.join(fields)}\n")


def make_root(
    tmp_path: Path, *, mem_total_bytes: int = 64 * GIB, mem_available_bytes: int = 48 * GIB
) -> Path:
    """A root with meminfo only (no cgroup files at all)."""
    root = tmp_path / "root"
    write_meminfo(root, mem_total_bytes=mem_total_bytes, mem_available_bytes=mem_available_bytes)
    return root
