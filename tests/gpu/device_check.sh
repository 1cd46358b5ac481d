#!/usr/bin/env bash
# One pass over everything that needs a CUDA device: the gpu-marked tests, the bench, and a
# direct throughput probe of the CUDA engine against plain page-locked copies. Bounded in time
# (about eight and a half minutes at most: 255 s tests, 90 s probe, 150 s bench; usually far
# less), runs the repository in place, and prints a compact report.
# The full log goes to ${OUT:-/tmp}/device_check.log.
set -u -o pipefail

cd "$(dirname "$0")/../.." || exit 2
OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/device_check.log"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
: >"$LOG"

say() { printf '%s\n' "$*" | tee -a "$LOG"; }

say "== device"
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>&1 || true; } | tee -a "$LOG"
python -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tee -a "$LOG"
say "ulimit -l (locked memory): $(ulimit -l)"

say "== gpu tests (engine, page-locking, and the service on cuda: tests/gpu/test_cuda_service.py)"
[ -f tests/gpu/test_cuda_service.py ] || say "MISSING tests/gpu/test_cuda_service.py"
# No asyncio plugin is needed by these tests; keep the run independent of the plugin's
# ini options (strict config would reject them when the plugin is missing).
# -v writes each test's outcome as it ends, so a run killed on time-out still shows what
# passed and failed before it (a test blocked in a thread wait can outlast SIGINT's 15 s of
# grace, and then pytest's summary is lost); faulthandler dumps every thread of a test stuck
# for 100 s; SIGINT first, so the summary is printed whenever pytest can.
timeout -s INT -k 15 240 python -m pytest -m gpu -v -rfEs -p no:cacheprovider -o addopts="" \
    -o faulthandler_timeout=100 -W "ignore::pytest.PytestConfigWarning" tests/gpu \
    >"$OUT_DIR/gpu_tests.log" 2>&1
tests_rc=$?
cat "$OUT_DIR/gpu_tests.log" >>"$LOG"
grep -E ' (FAILED|ERROR)( |$)|^(FAILED|ERROR) |(passed|failed|error|skipped).* in [0-9.]+s' \
    "$OUT_DIR/gpu_tests.log" | tail -n 25
say "last test started: $(grep -E '::' "$OUT_DIR/gpu_tests.log" | tail -n 1)"
say "gpu tests exit code: $tests_rc"

say "== engine probe (device-timed, GB/s = 1e9 B/s)"
timeout 90 python - <<'PY' 2>&1 | tee -a "$LOG"
import asyncio, time
import numpy as np
import torch
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.pool import HostPool
from dsa_async.kinds import Direction
from dsa_async.transfer.batch import CopyBatch
from dsa_async.transfer.buffers import bind_pool
from dsa_async.transfer.cuda import CudaEngine
from dsa_async.transfer.handoff import LoopHandoff

dev = torch.device("cuda", 0)
# Two halves of 640 MiB: the arena (1.25 GiB) spans more than one 1 GiB registration chunk, so
# the probe's copies cross registration edges as a production-sized pool's do.
nbytes = 640 << 20

def plain():
    host = torch.empty(2 * nbytes, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(2 * nbytes, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    def timed(ops):
        torch.cuda.synchronize(); t = time.perf_counter()
        for s, fn in ops:
            with torch.cuda.stream(s):
                fn()
        torch.cuda.synchronize(); return time.perf_counter() - t
    h2d = lambda: gpu[:nbytes].copy_(host[:nbytes], non_blocking=True)
    d2h = lambda: host[nbytes:].copy_(gpu[nbytes:], non_blocking=True)
    timed([(s1, h2d), (s2, d2h)])
    r = {k: [] for k in ("h2d", "d2h", "both")}
    for _ in range(5):
        r["h2d"].append(timed([(s1, h2d)])); r["d2h"].append(timed([(s2, d2h)]))
        r["both"].append(timed([(s1, h2d), (s2, d2h)]))
    return {k: (2 if k == "both" else 1) * nbytes / min(v) / 1e9 for k, v in r.items()}

def engine_probe(random_device):
    g = dsa_indexer()  # 61 layers, 8,448 B per page and layer
    pages = 2 * (nbytes // g.bytes_per_page)  # two halves of ~512 MiB
    t = time.perf_counter()
    pool = HostPool.create([g], pages)
    alloc_s = time.perf_counter() - t
    device = torch.randint(0, 256, (g.num_layers, pages, g.bytes_per_page_per_layer),
                           dtype=torch.uint8, device=dev)
    half = pages // 2
    rng = np.random.default_rng(0)
    dev_a = rng.permutation(half) if random_device else np.arange(half)
    dev_b = half + (rng.permutation(half) if random_device else np.arange(half))
    host_a, host_b = np.arange(half), np.arange(half, pages)
    batch_bytes = half * g.bytes_per_page
    out = {}

    async def main():
        loop = asyncio.get_running_loop()
        t = time.perf_counter()
        engine = await asyncio.to_thread(CudaEngine, {g.name: bind_pool(g, pool.arenas[g.name], device)},
                                         LoopHandoff(loop), lambda h: None)
        out["pin_s"] = time.perf_counter() - t
        out["pinned_bytes"] = engine.pinned_bytes
        out["registrations"] = len(engine._pinning.registrations)
        assert out["pinned_bytes"] > engine.pin_chunk_bytes, "probe arena within one chunk"
        async def run(*batches):
            t = time.perf_counter()
            hs = [engine.submit(b()) for b in batches]
            for h in hs:
                await asyncio.to_thread(h.done.wait, 60)
                assert h.error is None, h.error
            return time.perf_counter() - t, hs
        d2h = lambda: CopyBatch(Direction.D2H, host_a, dev_a, after=(engine.capture_producer(),))
        h2d = lambda: CopyBatch(Direction.H2D, host_b, dev_b)
        await run(d2h, h2d)
        wall = {"d2h": 1e9, "h2d": 1e9, "both": 1e9}
        device_s = {"d2h": 1e9, "h2d": 1e9}
        for _ in range(4):  # interleaved, best of four
            for key, batches in (("d2h", (d2h,)), ("h2d", (h2d,)), ("both", (d2h, h2d))):
                w, hs = await run(*batches)
                wall[key] = min(wall[key], w)
                if key in device_s:
                    device_s[key] = min(device_s[key], hs[0].duration_s)
        out.update({k: batch_bytes / v / 1e9 for k, v in device_s.items()})
        out["both"] = 2 * batch_bytes / wall["both"] / 1e9
        out["both_vs_one"] = (wall["d2h"] + wall["h2d"]) / wall["both"]  # throughput ratio
        await asyncio.to_thread(engine.close)

    asyncio.run(main())
    out["alloc_s"] = alloc_s
    return out

p = plain()
print(f"plain page-locked copy: h2d {p['h2d']:.1f} GB/s, d2h {p['d2h']:.1f} GB/s, "
      f"both at once {p['both']:.1f} GB/s")
for random_device in (False, True):
    e = engine_probe(random_device)
    label = "random device pages" if random_device else "contiguous pages   "
    print(f"engine, {label}: h2d {e['h2d']:.1f} GB/s ({e['h2d'] / p['h2d']:.0%} of plain), "
          f"d2h {e['d2h']:.1f} GB/s ({e['d2h'] / p['d2h']:.0%}), both {e['both']:.1f} GB/s "
          f"({e['both_vs_one']:.2f}x one direction, wall clock)")
    print(f"  page-locked {e['pinned_bytes']:,} B in {e['registrations']} registrations in "
          f"{e['pin_s']:.2f} s (allocation + zero-fill {e['alloc_s']:.2f} s)")
PY
probe_rc=$?
say "engine probe exit code: $probe_rc"

say "== bench (--backend cuda --quick)"
timeout 150 python -m dsa_async bench --backend cuda --quick --json "$OUT_DIR/bench.json" \
    >"$OUT_DIR/bench.log" 2>&1
bench_rc=$?
cat "$OUT_DIR/bench.log" >>"$LOG"
if [ -s "$OUT_DIR/bench.json" ]; then
    python - "$OUT_DIR/bench.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
data = json.load(open(sys.argv[1]))
targets = data.get("targets", {})
for name, value in sorted(data.get("results", {}).items()):
    t = targets.get(name, {})
    met = {True: "met", False: "MISSED", None: ""}[t.get("met")]
    shown = "n/a" if value is None else f"{value:.3g}"
    print(f"  {name}: {shown} {t.get('unit', '')} (target {t.get('comparison', '')} "
          f"{t.get('target', '')}) {met}")
for scenario, message in data.get("errors", {}).items():
    print(f"  FAILED {scenario}: {message}")
PY
else
    tail -n 20 "$OUT_DIR/bench.log"
fi
say "bench exit code: $bench_rc"

say "== summary: tests rc=$tests_rc probe rc=$probe_rc bench rc=$bench_rc (ulimit -l $(ulimit -l))"
[ "$tests_rc" -eq 0 ] && [ "$probe_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
