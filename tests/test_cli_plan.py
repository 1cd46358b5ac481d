import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_roots import GIB, Level, make_root, write_cgroup_v1, write_proc_stat

from dsa_async.cli import main
from dsa_async.host_memory.budget import ROOT_ENV
from dsa_async.host_memory.ledger import LEDGER_ENV, HostLedger

REPO = Path(__file__).resolve().parents[1]
AVAILABLE_BYTES = 48 * GIB - GIB  # the fake root's MemAvailable minus the default 1 GiB reserve


@pytest.fixture
def env(tmp_path, monkeypatch):
    root = make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    monkeypatch.setenv(ROOT_ENV, str(root))
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))
    return {ROOT_ENV: str(root), LEDGER_ENV: str(tmp_path / "ledger")}


def run_json(capsys, *args):
    code = main(["plan", "--model", "deepseek-v3.2", *args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_json_reports_the_indexer_geometry_for_one_gb(env, capsys):
    code, data, err = run_json(capsys, "--host-pool-gb", "1")
    assert (code, err) == (0, "")
    (pool,) = data["pools"]
    assert pool["name"] == "indexer"
    assert (
        pool["bytes_per_token_per_layer"],
        pool["bytes_per_page_per_layer"],
        pool["bytes_per_page"],
    ) == (
        132,
        8448,
        515_328,
    )
    assert pool["num_pages"] == data["num_pages"] == 1940
    assert pool["requested_bytes"] == data["requested_bytes"] == 1940 * 515_328
    assert data["available_bytes"] == AVAILABLE_BYTES
    assert data["fits"] is True
    assert data["max_pages_that_fit"] == AVAILABLE_BYTES // 515_328
    assert data["budget"]["mem_total_bytes"] == 64 * GIB and data["budget"]["limiter"] == "mem_available"
    assert data["budget"]["reserve_bytes"] == GIB


def test_kv_pool_shares_the_page_count_and_draft_adds_a_layer(env, capsys):
    code, data, _ = run_json(capsys, "--host-pool-gb", "10", "--kv-dtype", "fp8", "--with-draft")
    assert code == 0
    assert [(p["name"], p["num_layers"], p["num_pages"]) for p in data["pools"]] == [
        ("indexer", 62, data["num_pages"]),
        ("kv", 62, data["num_pages"]),
    ]
    assert data["bytes_per_shared_page"] == 64 * (132 + 656) * 62


def test_text_output_shows_pools_budget_and_verdict(env, capsys):
    assert main(["plan", "--host-pool-gb", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for text in (
        "indexer",
        "132",
        "8,448",
        "515,328",
        "1,940",
        "999,736,320",
        "verdict: fits",
        "RLIMIT_MEMLOCK",
    ):
        assert text in out


def test_ranks_per_host_checks_n_times_the_request(env, capsys):
    code, data, _ = run_json(capsys, "--host-pool-gb", "20", "--ranks-per-host", "4")
    assert code == 3 and data["fits"] is False
    assert data["total_requested_bytes"] == 4 * data["requested_bytes"]
    assert main(["plan", "--host-pool-gb", "5", "--ranks-per-host", "4"]) == 0
    assert "x 4 ranks per host" in capsys.readouterr().out


def test_a_pool_larger_than_the_machine_exits_3_with_the_full_refusal(env, capsys):
    code, data, err = run_json(capsys, "--host-pool-gb", "100000")
    assert code == 3 and data["fits"] is False
    for text in (
        "requested: 100.00 TB",
        "indexer: 194,051,167 pages x 61 layers x 8,448 B/page/layer",
        "available: 50.47 GB (50,465,865,728 B)",
        "total: 68.72 GB (68,719,476,736 B) (MemTotal)",
        "limited by: MemAvailable",
        f"largest that fits: {AVAILABLE_BYTES // 515_328:,} pages",
        "lower --host-pool-gb / ServiceConfig.host_pool to <= 50.46 GB",
        "or use auto",
    ):
        assert text in err
    assert "Traceback" not in err


def test_auto_fits_the_budget(env, capsys):
    code, data, _ = run_json(capsys, "--host-pool-gb", "auto", "--kv-dtype", "bf16")
    assert code == 0 and data["auto"] is True and data["fits"] is True
    assert (
        data["num_pages"] == data["max_pages_that_fit"] == AVAILABLE_BYTES // (515_328 + 64 * 1152 * 61)
    )


def test_reserve_gb_overrides_the_reserve(env, capsys):
    _, data, _ = run_json(capsys, "--host-pool-gb", "1", "--reserve-gb", "2.5")
    assert data["budget"]["reserve_bytes"] == 2_500_000_000
    assert data["available_bytes"] == 48 * GIB - 2_500_000_000


def test_memory_and_swap_figures_are_shown_apart_and_add_up_to_the_headroom(env, capsys):
    """cgroup v1 whose memory + swap binds: the text shows the memory limit and working set,
    then memory + swap's own, then the headroom and the file that binds; the JSON gives the
    memory + swap working set, so memsw limit - memsw working set = headroom."""
    root = Path(env[ROOT_ENV])
    write_cgroup_v1(root, "/docker/abc", {"/docker/abc": Level(8 * GIB, 6 * GIB, GIB // 4)})
    level_dir = root / "sys/fs/cgroup/memory/docker/abc"
    (level_dir / "memory.memsw.limit_in_bytes").write_text(f"{10 * GIB}\n")
    (level_dir / "memory.memsw.usage_in_bytes").write_text(f"{19 * GIB // 2}\n")
    assert main(["plan", "--host-pool-gb", "1", "--reserve-gb", "0"]) == 3
    assert (
        "  cgroup /docker/abc (v1): memory.limit_in_bytes 8.59 GB, working set 6.17 GB; "
        "memory + swap: memory.memsw.limit_in_bytes 10.74 GB, working set 9.93 GB; "
        "headroom 805.31 MB (memory.memsw.limit_in_bytes binds)\n"
    ) in capsys.readouterr().out
    _, data, _ = run_json(capsys, "--host-pool-gb", "1", "--reserve-gb", "0")
    (level,) = data["budget"]["cgroups"]
    assert level["memsw_working_set_bytes"] == 37 * GIB // 4
    assert level["headroom_bytes"] == level["memsw_limit_bytes"] - level["memsw_working_set_bytes"]
    assert level["limit_bytes"] - level["working_set_bytes"] > level["headroom_bytes"]


@pytest.mark.parametrize(
    "args",
    [
        ["--host-pool-gb", "abc"],
        ["--host-pool-gb", "-1"],
        ["--host-pool-gb", "0"],
        ["--host-pool-gb", "nan"],
        ["--host-pool-gb", "inf"],
        ["--host-pool-gb", "1e300"],  # finite, but not as bytes
        ["--host-pool-gb", "1", "--reserve-gb", "1e300"],
        ["--host-pool-gb", "1e-12"],
        ["--host-pool-gb", "1", "--model", "llama"],
        ["--host-pool-gb", "1", "--kv-dtype", "fp16"],
        ["--host-pool-gb", "1", "--ranks-per-host", "0"],
        ["--host-pool-gb", "1", "--reserve-gb", "-1"],
        [],
    ],
)
def test_bad_arguments_exit_2_with_usage(env, capsys, args):
    assert main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: dsa-async plan" in err


def test_missing_command_exits_2(capsys):
    assert main([]) == 2
    assert "usage: dsa-async" in capsys.readouterr().err


def test_size_below_one_page_exits_2_naming_the_smallest_size(env, capsys):
    assert main(["plan", "--host-pool-gb", "0.0001"]) == 2
    assert (
        "smallest size that holds one page of indexer is 515.33 kB (515,328 B)"
        in capsys.readouterr().err
    )


def test_plan_counts_the_ledger_but_never_writes_it(env, capsys, tmp_path):
    ledger_dir = Path(env[LEDGER_ENV])
    assert main(["plan", "--host-pool-gb", "1", "--json"]) == 0
    assert not ledger_dir.exists()  # not even created
    capsys.readouterr()
    held = HostLedger(ledger_dir).reserve(4 * GIB, label="rank0")
    proc_root = tmp_path / "procroot"
    write_proc_stat(proc_root, 999_999, 1)  # never matched: the stored entry below is dead
    stored = json.loads((ledger_dir / "ledger.json").read_text())
    stored["entries"].append(dict(stored["entries"][0], id="dead", pid=999_999, start_time_ticks=2))
    (ledger_dir / "ledger.json").write_text(json.dumps(stored))
    before = (ledger_dir / "ledger.json").read_bytes()
    code, data, _ = run_json(capsys, "--host-pool-gb", "1")
    assert code == 0
    assert data["pending_bytes"] == 4 * GIB and data["available_bytes"] == AVAILABLE_BYTES - 4 * GIB
    assert [r["label"] for r in data["reservations"]] == ["rank0"]
    assert (ledger_dir / "ledger.json").read_bytes() == before  # the dead entry was not reclaimed
    held.release()


def test_python_m_dsa_async_plan_prints_json(env):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsa_async",
            "plan",
            "--model",
            "deepseek-v3.2",
            "--host-pool-gb",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (0, "")
    (pool,) = json.loads(result.stdout)["pools"]
    assert (
        pool["bytes_per_token_per_layer"],
        pool["bytes_per_page_per_layer"],
        pool["bytes_per_page"],
    ) == (
        132,
        8448,
        515_328,
    )
