import errno
import re
import resource
import shutil
import tempfile
from pathlib import Path

import pytest
from fake_roots import (
    GIB,
    MIB,
    V1_UNLIMITED,
    Level,
    make_root,
    write_cgroup_v1,
    write_cgroup_v2,
    write_meminfo,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.errors import ConfigError
from dsa_async.host_memory.budget import (
    ROOT_ENV,
    BudgetLimiter,
    CgroupVersion,
    default_reserve_bytes,
    probe_host_budget,
    read_cgroup_levels,
    read_memlock_limit_bytes,
)


def probe(root, **kwargs):
    kwargs.setdefault("read_memlock", lambda: None)
    return probe_host_budget(root, **kwargs)


def test_meminfo_only_root_is_limited_by_mem_available_minus_the_default_reserve(tmp_path):
    root = make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    snap = probe(root)
    assert snap.mem_total_bytes == 64 * GIB
    assert snap.mem_available_bytes == 48 * GIB
    assert snap.levels == ()
    assert snap.limit_bytes == 64 * GIB
    assert snap.reserve_bytes == GIB  # min(1 GiB, 5 % of 64 GiB)
    assert snap.available_bytes == 47 * GIB
    assert snap.limiter is BudgetLimiter.MEM_AVAILABLE
    assert snap.limiter_cgroup_path is None and snap.limiter_level is None


def test_default_reserve_is_five_percent_of_a_small_limit(tmp_path):
    root = make_root(tmp_path, mem_total_bytes=8 * GIB, mem_available_bytes=6 * GIB)
    snap = probe(root)
    assert snap.reserve_bytes == 8 * GIB * 5 // 100 == 429_496_729
    assert snap.available_bytes == 6 * GIB - 429_496_729
    assert default_reserve_bytes(100 * GIB) == GIB


@pytest.mark.parametrize("reserve_bytes", [0, 123, 3 * GIB])
def test_reserve_override_replaces_the_default(tmp_path, reserve_bytes):
    snap = probe(make_root(tmp_path), reserve_bytes=reserve_bytes)
    assert snap.reserve_bytes == reserve_bytes
    assert snap.available_bytes == 48 * GIB - reserve_bytes


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_reserve_is_a_config_error(tmp_path, bad):
    with pytest.raises(ConfigError, match="reserve_bytes"):
        probe(make_root(tmp_path), reserve_bytes=bad)


@pytest.mark.parametrize("bad", ["no", "", 0, 1, [1], None, 1.0], ids=repr)
def test_hugepages_takes_only_a_bool(tmp_path, bad):
    with pytest.raises(ConfigError, match="hugepages must be True or False"):
        probe(make_root(tmp_path), hugepages=bad)


def test_reserve_larger_than_the_budget_leaves_zero_not_negative(tmp_path):
    assert probe(make_root(tmp_path), reserve_bytes=100 * GIB).available_bytes == 0


def test_v2_leaf_limit_minus_working_set_caps_the_budget(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(
        root,
        "/kubepods/pod1/ctr",
        {
            "/kubepods": Level(None, 30 * GIB),
            "/kubepods/pod1": Level(16 * GIB, 10 * GIB, inactive_file_bytes=2 * GIB),
            "/kubepods/pod1/ctr": Level(12 * GIB, 6 * GIB, inactive_file_bytes=1 * GIB),
        },
    )
    snap = probe(root)
    assert [lvl.path for lvl in snap.levels] == ["/kubepods/pod1/ctr", "/kubepods/pod1", "/kubepods"]
    leaf, pod, top = snap.levels
    assert leaf.version is CgroupVersion.V2
    assert (leaf.limit_bytes, leaf.working_set_bytes, leaf.headroom_bytes) == (
        12 * GIB,
        5 * GIB,
        7 * GIB,
    )
    assert (pod.limit_bytes, pod.working_set_bytes, pod.headroom_bytes) == (16 * GIB, 8 * GIB, 8 * GIB)
    assert (top.limit_bytes, top.headroom_bytes) == (None, None)
    assert snap.limit_bytes == 12 * GIB
    assert snap.reserve_bytes == 12 * GIB * 5 // 100
    assert snap.available_before_reserve_bytes == 7 * GIB
    assert snap.available_bytes == 7 * GIB - 12 * GIB * 5 // 100
    assert snap.limiter is BudgetLimiter.CGROUP
    assert snap.limiter_cgroup_path == "/kubepods/pod1/ctr"
    assert snap.limiter_level == leaf


def test_a_parent_tighter_than_the_child_wins(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(
        root,
        "/parent/child",
        {"/parent": Level(8 * GIB, 7 * GIB), "/parent/child": Level(32 * GIB, 2 * GIB)},
    )
    snap = probe(root, reserve_bytes=0)
    assert snap.available_bytes == 1 * GIB
    assert snap.limiter is BudgetLimiter.CGROUP
    assert snap.limiter_cgroup_path == "/parent"
    assert snap.limit_bytes == 8 * GIB


def test_v2_max_everywhere_means_no_cgroup_limit(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(root, "/a/b", {"/a": Level(None, GIB), "/a/b": Level(None, GIB)})
    snap = probe(root, reserve_bytes=0)
    assert all(lvl.limit_bytes is None for lvl in snap.levels) and len(snap.levels) == 2
    assert snap.limiter is BudgetLimiter.MEM_AVAILABLE
    assert snap.available_bytes == 48 * GIB
    assert snap.limit_bytes == 64 * GIB


def test_v1_limit_uses_total_inactive_file_for_the_working_set(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v1(
        root,
        "/docker/abc",
        {
            "/": Level(None, 20 * GIB),
            "/docker": Level(None, 5 * GIB),
            "/docker/abc": Level(4 * GIB, 3 * GIB, GIB),
        },
    )
    snap = probe(root, reserve_bytes=0)
    leaf = snap.levels[0]
    assert leaf.version is CgroupVersion.V1 and leaf.path == "/docker/abc"
    assert (leaf.usage_bytes, leaf.inactive_file_bytes, leaf.working_set_bytes) == (
        3 * GIB,
        GIB,
        2 * GIB,
    )
    assert leaf.headroom_bytes == 2 * GIB
    assert [lvl.path for lvl in snap.levels] == ["/docker/abc", "/docker", "/"]
    assert snap.available_bytes == 2 * GIB
    assert snap.limiter_cgroup_path == "/docker/abc"
    assert snap.limit_bytes == 4 * GIB


@pytest.mark.parametrize("unlimited_bytes", [9223372036854771712, 2**62, 2**63 - 1])
def test_v1_huge_limit_means_unlimited(tmp_path, unlimited_bytes):
    root = make_root(tmp_path)
    write_cgroup_v1(root, "/x", {"/x": Level(None, GIB)})
    (root / "sys/fs/cgroup/memory/x/memory.limit_in_bytes").write_text(f"{unlimited_bytes}\n")
    snap = probe(root, reserve_bytes=0)
    assert snap.levels[0].limit_bytes is None
    assert snap.limiter is BudgetLimiter.MEM_AVAILABLE
    assert snap.limit_bytes == 64 * GIB


def test_v1_mount_rooted_at_the_container_cgroup(tmp_path):
    # Docker without a cgroup namespace: the container's cgroup is mounted as the hierarchy root.
    root = make_root(tmp_path)
    write_cgroup_v1(
        root, "/docker/abc", {"/docker/abc": Level(6 * GIB, 2 * GIB)}, mount_root="/docker/abc"
    )
    assert (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
    snap = probe(root, reserve_bytes=0)
    assert [(lvl.path, lvl.headroom_bytes) for lvl in snap.levels] == [("/docker/abc", 4 * GIB)]
    assert snap.available_bytes == 4 * GIB


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_bind_of_a_subtree_does_not_hide_the_ancestors_limits(tmp_path, version):
    # The full hierarchy is mounted, and a subtree holding the process's cgroup is mounted
    # again elsewhere: the limit two levels up must still cap the budget, whichever mount
    # mountinfo lists first.
    root = make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    levels = {"/x": Level(2 * GIB, GIB), "/x/a": Level(None, GIB), "/x/a/b": Level(None, GIB)}
    write = write_cgroup_v2 if version == "v2" else write_cgroup_v1
    write(root, "/x/a/b", levels)
    full = root / ("sys/fs/cgroup" if version == "v2" else "sys/fs/cgroup/memory")
    shutil.copytree(full / "x/a", root / "mnt/sub")
    fstype, options = ("cgroup2", "rw") if version == "v2" else ("cgroup", "rw,memory")
    mountinfo = root / "proc/self/mountinfo"
    lines = mountinfo.read_text().splitlines(keepends=True)
    bind = f"40 23 0:30 /x/a /mnt/sub rw,relatime - {fstype} {fstype} {options}\n"
    for order in (lines + [bind], [bind] + lines):
        mountinfo.write_text("".join(order))
        snap = probe(root, reserve_bytes=0)
        assert [lvl.path for lvl in snap.levels] == ["/x/a/b", "/x/a", "/x"]
        assert snap.available_bytes == GIB
        assert snap.limiter is BudgetLimiter.CGROUP and snap.limiter_cgroup_path == "/x"


def test_mountpoint_with_an_escaped_space(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(root, "/a", {"/a": Level(2 * GIB, GIB)}, mountinfo=False)
    (root / "sys/fs/cgroup").rename(root / "sys/fs/my cgroup")
    (root / "proc/self/mountinfo").write_text(
        r"30 23 0:30 / /sys/fs/my\040cgroup rw - cgroup2 cgroup2 rw" + "\n"
    )
    assert probe(root, reserve_bytes=0).available_bytes == GIB


def test_hugepage_backed_arena_is_capped_by_free_hugepages(tmp_path):
    root = tmp_path / "root"
    write_meminfo(
        root,
        mem_total_bytes=64 * GIB,
        mem_available_bytes=48 * GIB,
        hugepages_total=1024,
        hugepages_free=512,
    )
    snap = probe(root, reserve_bytes=0, hugepages=True)
    assert snap.hugepages_free_bytes == 512 * 2 * MIB == GIB
    assert snap.available_bytes == GIB
    assert snap.limiter is BudgetLimiter.HUGEPAGES


def test_reserved_hugepages_are_not_free(tmp_path):
    """HugePages_Rsvd pages are promised to existing mappings: they are not the arena's."""
    root = tmp_path / "root"
    write_meminfo(root, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB,
                  hugepages_total=1024, hugepages_free=600, hugepages_reserved=500)
    snap = probe(root, reserve_bytes=0, hugepages=True)
    assert snap.hugepages_free_bytes == snap.available_bytes == 100 * 2 * MIB


def test_v2_memory_high_below_memory_max_is_the_limit(tmp_path):
    """Above memory.high the cgroup is throttled and reclaimed hard, and a page-locked or
    zero-filled arena cannot be reclaimed: the lower of memory.high and memory.max binds."""
    root = make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    write_cgroup_v2(root, "/svc", {"/svc": Level(limit_bytes=16 * GIB, usage_bytes=2 * GIB)})
    (root / "sys/fs/cgroup/svc/memory.high").write_text(f"{4 * GIB}\n")
    snap = probe(root, reserve_bytes=0)
    assert snap.available_bytes == 2 * GIB
    assert snap.limiter_cgroup_path == "/svc"
    (level,) = read_cgroup_levels(root)
    assert (level.limit_bytes, level.limit_file) == (4 * GIB, "memory.high")


@pytest.mark.parametrize("max_file", ["missing", "max"])
def test_v2_memory_high_binds_without_a_memory_max(tmp_path, max_file):
    """memory.high alone (memory.max missing, or ``max``) is the level's limit; only a level
    with neither file, or without memory.current, is skipped."""
    root = make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    write_cgroup_v2(root, "/svc", {"/svc": Level(limit_bytes=16 * GIB, usage_bytes=2 * GIB)})
    level_dir = root / "sys/fs/cgroup/svc"
    if max_file == "missing":
        (level_dir / "memory.max").unlink()
    else:
        (level_dir / "memory.max").write_text("max\n")
    (level_dir / "memory.high").write_text(f"{4 * GIB}\n")
    assert probe(root, reserve_bytes=0).available_bytes == 2 * GIB
    (level,) = read_cgroup_levels(root)
    assert (level.limit_bytes, level.limit_file, level.headroom_bytes) == (
        4 * GIB, "memory.high", 2 * GIB)
    (level_dir / "memory.high").write_text("max\n")
    (level,) = read_cgroup_levels(root)
    assert (level.limit_bytes, level.headroom_bytes) == (None, None)
    assert probe(root, reserve_bytes=0).available_bytes == 48 * GIB
    (level_dir / "memory.high").unlink()
    assert len(read_cgroup_levels(root)) == (0 if max_file == "missing" else 1)


def _v1_memory_8_of_6_gib_memsw_10_of_9_5_gib(tmp_path):
    """A v1 cgroup using 6 of 8 GiB of memory and 9.5 of 10 GiB of memory + swap: its root and
    the level's directory."""
    root = make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    write_cgroup_v1(root, "/docker/abc",
                    {"/docker/abc": Level(limit_bytes=8 * GIB, usage_bytes=6 * GIB)})
    level_dir = root / "sys/fs/cgroup/memory/docker/abc"
    (level_dir / "memory.memsw.limit_in_bytes").write_text(f"{10 * GIB}\n")
    (level_dir / "memory.memsw.usage_in_bytes").write_text(f"{int(9.5 * GIB)}\n")
    return root, level_dir


def test_v1_memory_and_swap_limit_binds_when_memory_is_swapped_out(tmp_path):
    """With swap accounting a cgroup's memory + swap is charged: pages swapped out lower no
    charge, so memsw.limit - memsw.usage bounds a new arena when it is the smaller headroom."""
    root, level_dir = _v1_memory_8_of_6_gib_memsw_10_of_9_5_gib(tmp_path)
    assert probe(root, reserve_bytes=0).available_bytes == GIB // 2
    (level_dir / "memory.memsw.usage_in_bytes").write_text(f"{7 * GIB}\n")  # little swapped
    assert probe(root, reserve_bytes=0).available_bytes == 2 * GIB  # memory's headroom binds


def test_free_hugepages_are_reported_but_do_not_cap_a_normal_arena(tmp_path):
    root = tmp_path / "root"
    write_meminfo(
        root, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB, hugepages_total=8, hugepages_free=8
    )
    snap = probe(root, reserve_bytes=0)
    assert snap.hugepages_free_bytes == 16 * MIB
    assert snap.available_bytes == 48 * GIB
    assert snap.limiter is BudgetLimiter.MEM_AVAILABLE


def test_hugepages_without_hugepage_lines_is_a_config_error(tmp_path):
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/meminfo").write_text("MemTotal: 1048576 kB\nMemAvailable: 524288 kB\n")
    assert probe(root).hugepages_free_bytes is None
    with pytest.raises(ConfigError, match="HugePages_Free"):
        probe(root, hugepages=True)


def test_a_level_with_missing_files_is_skipped(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(root, "/a/b", {"/a": Level(3 * GIB, GIB), "/a/b": Level(GIB, GIB)})
    (root / "sys/fs/cgroup/a/b/memory.max").unlink()
    (root / "sys/fs/cgroup/a/memory.stat").unlink()  # no stat: the whole usage counts
    snap = probe(root, reserve_bytes=0)
    assert [lvl.path for lvl in snap.levels] == ["/a"]
    assert snap.available_bytes == 2 * GIB


def test_missing_mountinfo_falls_back_to_the_standard_mountpoints(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(root, "/a", {"/a": Level(3 * GIB, GIB)}, mountinfo=False)
    assert probe(root, reserve_bytes=0).available_bytes == 2 * GIB


def test_missing_cgroup_files_mean_no_levels(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(root, "/a", {"/a": Level(3 * GIB, GIB)})
    (root / "proc/self/cgroup").unlink()
    assert probe(root).levels == ()


def test_working_set_and_headroom_never_go_negative(tmp_path):
    root = make_root(tmp_path)
    write_cgroup_v2(
        root, "/a/b", {"/a": Level(GIB, 2 * GIB), "/a/b": Level(None, GIB, inactive_file_bytes=2 * GIB)}
    )
    snap = probe(root, reserve_bytes=0)
    assert snap.levels[0].working_set_bytes == 0
    assert snap.levels[1].headroom_bytes == 0
    assert snap.available_bytes == 0


def test_missing_meminfo_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"proc/meminfo.*DSA_ASYNC_ROOT"):
        probe(tmp_path)


def test_root_comes_from_the_environment_when_not_given(tmp_path, monkeypatch):
    root = make_root(tmp_path, mem_total_bytes=4 * GIB, mem_available_bytes=3 * GIB)
    monkeypatch.setenv(ROOT_ENV, str(root))
    snap = probe_host_budget(reserve_bytes=0)
    assert snap.root == str(root)
    assert snap.mem_total_bytes == 4 * GIB and snap.available_bytes == 3 * GIB


def test_memlock_is_reported_but_never_caps(tmp_path):
    root = make_root(tmp_path)
    snap = probe_host_budget(root, reserve_bytes=0, read_memlock=lambda: 8 * MIB)
    assert snap.memlock_limit_bytes == 8 * MIB
    assert snap.available_bytes == 48 * GIB
    assert probe_host_budget(root).memlock_limit_bytes == read_memlock_limit_bytes()


def test_read_memlock_matches_getrlimit():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert read_memlock_limit_bytes() == (None if soft == resource.RLIM_INFINITY else soft)


def test_the_real_machine_probe_is_consistent():
    snap = probe_host_budget("/")
    assert 0 < snap.mem_available_bytes <= snap.mem_total_bytes
    assert snap.limit_bytes <= snap.mem_total_bytes
    assert snap.available_bytes <= snap.available_before_reserve_bytes <= snap.mem_available_bytes


levels_strategy = st.lists(
    st.tuples(
        st.one_of(st.none(), st.integers(1, 64 * GIB)), st.integers(0, 64 * GIB), st.integers(0, 8 * GIB)
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=25, deadline=None)
@given(levels=levels_strategy, mem_available_kib=st.integers(1, 64 * MIB))
def test_available_is_the_minimum_of_every_headroom(levels, mem_available_kib):
    paths = ["/" + "/".join(f"l{j}" for j in range(i + 1)) for i in range(len(levels))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_meminfo(root, mem_total_bytes=64 * GIB, mem_available_bytes=mem_available_kib * 1024)
        write_cgroup_v2(root, paths[-1], {p: Level(*lv) for p, lv in zip(paths, levels, strict=True)})
        snap = probe(root, reserve_bytes=0)
    headrooms = [max(0, lim - max(0, use - inact)) for lim, use, inact in levels if lim is not None]
    assert snap.available_bytes == min([mem_available_kib * 1024] + headrooms)
    assert len(snap.levels) == len(levels)


# --- files the probe cannot use: never a silently wider budget, never a leaked OSError ----------

def _tree_with_every_file(tmp_path, version):
    """A root whose cgroup level has every file the probe reads: (root, the level's directory)."""
    root = make_root(tmp_path)
    if version == "v2":
        write_cgroup_v2(root, "/a", {"/a": Level(8 * GIB, 2 * GIB, GIB)})
        level_dir = root / "sys/fs/cgroup/a"
        (level_dir / "memory.high").write_text(f"{6 * GIB}\n")
    else:
        write_cgroup_v1(root, "/a", {"/a": Level(8 * GIB, 2 * GIB, GIB)})
        level_dir = root / "sys/fs/cgroup/memory/a"
        (level_dir / "memory.memsw.limit_in_bytes").write_text(f"{10 * GIB}\n")
        (level_dir / "memory.memsw.usage_in_bytes").write_text(f"{3 * GIB}\n")
    probe(root)  # every file as written is fine
    return root, level_dir


FIGURE_FILES = [  # (version, file under the level's directory or the root, how to write a value)
    ("v2", "memory.max", "{}\n"), ("v2", "memory.current", "{}\n"), ("v2", "memory.high", "{}\n"),
    ("v2", "memory.stat", "anon 4096\ninactive_file {}\nactive_file 0\n"),
    ("v1", "memory.limit_in_bytes", "{}\n"), ("v1", "memory.usage_in_bytes", "{}\n"),
    ("v1", "memory.memsw.limit_in_bytes", "{}\n"), ("v1", "memory.memsw.usage_in_bytes", "{}\n"),
    ("v1", "memory.stat", "total_cache 8192\ntotal_inactive_file {}\n"),
    ("v2", "/proc/meminfo", "MemTotal: {} kB\nMemAvailable: 1024 kB\n"),
    ("v2", "/proc/meminfo", "MemTotal: 2048 kB\nMemAvailable: {} kB\n"),
]
# Unicode digits (str.isdigit() takes them all; int() takes only some), signs, fractions, words.
NOT_A_FIGURE = ["\u0661\u0662\u0663", "\u00b2", "\uff11\uff12", "12a", "-1", "+5", "1.5", "1e9",
                "0x10", "", "garbage", "unlimited"]


@pytest.mark.parametrize("version,name,template", FIGURE_FILES)
@pytest.mark.parametrize("bad", NOT_A_FIGURE)
def test_a_figure_that_is_not_an_ascii_number_is_a_config_error_naming_the_file(
        tmp_path, version, name, template, bad):
    """A limit, usage or meminfo figure the probe cannot read as plain ASCII digits is refused,
    naming the file and its contents: read as no limit it would widen the budget."""
    root, level_dir = _tree_with_every_file(tmp_path, version)
    path = root / name.lstrip("/") if name.startswith("/") else level_dir / name
    path.write_text(template.format(bad))
    with pytest.raises(ConfigError, match=re.escape(str(path))) as caught:
        probe(root)
    assert repr(bad) in str(caught.value) and "not a number" in str(caught.value)


@pytest.mark.parametrize("version,name", sorted({(v, n) for v, n, _ in FIGURE_FILES} | {
    ("v2", "/proc/self/cgroup"), ("v2", "/proc/self/mountinfo"),
    ("v1", "/proc/self/cgroup"), ("v1", "/proc/self/mountinfo")}))
@pytest.mark.parametrize("how", ["symlink-loop", "directory", "permission"])
def test_a_file_that_exists_but_cannot_be_read_is_a_config_error_naming_it(
        tmp_path, monkeypatch, version, name, how):
    """Unlike a missing file (no limit known there), a file that is there but unreadable may
    hold a limit: the probe refuses to guess instead of leaking the OSError."""
    root, level_dir = _tree_with_every_file(tmp_path, version)
    path = root / name.lstrip("/") if name.startswith("/") else level_dir / name
    path.unlink()
    if how == "symlink-loop":
        path.symlink_to(path.name)  # ELOOP
    elif how == "directory":
        path.mkdir()  # EISDIR
    else:  # root reads files whatever their mode: make the read itself fail
        path.write_text("0\n")
        real_read_text = Path.read_text

        def read_text(self, *args, **kwargs):
            if self == path:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_read_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(ConfigError, match=f"cannot read {re.escape(str(path))}"):
        probe(root)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_missing_optional_files_still_mean_none(tmp_path, version):
    root, level_dir = _tree_with_every_file(tmp_path, version)
    for name in ("memory.high", "memory.memsw.limit_in_bytes", "memory.memsw.usage_in_bytes",
                 "memory.stat"):
        (level_dir / name).unlink(missing_ok=True)
    (level,) = probe(root, reserve_bytes=0).levels
    assert (level.limit_bytes, level.inactive_file_bytes, level.headroom_bytes) == (
        8 * GIB, 0, 6 * GIB)


def test_v1_memsw_is_reported_apart_from_the_memory_limit_and_caps_only_the_headroom(tmp_path):
    """memory.memsw.limit_in_bytes is memory + swap: never the memory limit (limit_bytes, nor
    the snapshot's tightest limit); its headroom caps the budget when it is lower."""
    root, level_dir = _v1_memory_8_of_6_gib_memsw_10_of_9_5_gib(tmp_path)
    snap = probe(root, reserve_bytes=0)
    (level,) = snap.levels
    assert (level.limit_bytes, level.usage_bytes, level.working_set_bytes) == (
        8 * GIB, 6 * GIB, 6 * GIB)
    assert (level.memsw_limit_bytes, level.memsw_usage_bytes) == (10 * GIB, int(9.5 * GIB))
    assert (level.headroom_bytes, level.limit_file) == (GIB // 2, "memory.memsw.limit_in_bytes")
    assert snap.limit_bytes == 8 * GIB and snap.available_bytes == GIB // 2
    assert probe(root).reserve_bytes == default_reserve_bytes(8 * GIB)
    (level_dir / "memory.memsw.usage_in_bytes").write_text(f"{7 * GIB}\n")  # little swapped
    (level,) = probe(root, reserve_bytes=0).levels
    assert (level.limit_bytes, level.headroom_bytes, level.limit_file) == (
        8 * GIB, 2 * GIB, "memory.limit_in_bytes")
    (level_dir / "memory.memsw.limit_in_bytes").write_text(f"{V1_UNLIMITED}\n")
    (level,) = probe(root, reserve_bytes=0).levels
    assert (level.memsw_limit_bytes, level.headroom_bytes) == (None, 2 * GIB)
