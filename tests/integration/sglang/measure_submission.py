"""How long SGLang's scheduler thread spends in the plug-in per write and per load submission.

Run with the SGLang venv's python from the repository root (not collected by pytest):

    PY="$(bash .ci/sglang-env.sh)" && "$PY" tests/integration/sglang/measure_submission.py

SGLang's own cache is built by the harness with the plug-in on (CPU backend), and SGLang's own
controller drives it: each round inserts a sequence (write-through: ``start_writing`` submits its
backup), evicts it from the device, loads it back (``start_loading``) and reads it through the
getters. The time inside the engine's ``submit_device_to_host`` / ``submit_host_to_device`` is
what the scheduler thread pays per submission; the whole ``start_writing`` / ``start_loading``
call (SGLang's own bookkeeping included) is printed next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_shims  # noqa: E402,F401 - before SGLang is imported
from dsa_hicache_harness import DsaHiCacheSettings, build_dsa_hicache  # noqa: E402


def _timed(owner, name: str, into: list[float], cpu: list[float] | None = None) -> None:
    """Wrap ``owner.name`` to append its wall time (and the calling thread's CPU time)."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)
            if cpu is not None:
                cpu.append(time.thread_time() - started_cpu)

    setattr(owner, name, timed)


def _figures(label: str, seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    p90 = us[int(0.9 * (len(us) - 1))]
    return f"{label:<34} median {statistics.median(us):7.1f} us   p90 {p90:7.1f} us   n={len(us)}"


def _cold_numpy(samples: int = 200) -> list[float]:
    """What the machine charges one tiny op just after the thread slept 2 ms (for context)."""
    import torch

    tensor, costs = torch.arange(128), []
    for _ in range(samples):
        time.sleep(0.002)
        started = time.thread_time()
        tensor.numpy()
        costs.append(time.thread_time() - started)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--pages", type=int, default=2, help="pages per sequence")
    parser.add_argument("--layers", type=int, default=61)
    args = parser.parse_args()
    from sglang.srt.plugins import load_plugins

    os.environ["DSA_ASYNC_SGLANG"] = "1"
    load_plugins()
    settings = DsaHiCacheSettings(num_layers=args.layers, mem_layout="layer_first",
                                  io_backend="direct", write_policy="write_through",
                                  device_pool_pages=4 * args.pages)
    with tempfile.TemporaryDirectory() as workdir:
        cache = build_dsa_hicache(settings, Path(workdir))
        try:
            controller = cache.controller
            engine = controller.l2_transfer_engine
            writes, loads, start_writing, start_loading = [], [], [], []
            writes_cpu, loads_cpu = [], []
            _timed(engine, "submit_device_to_host", writes, writes_cpu)
            _timed(engine, "submit_host_to_device", loads, loads_cpu)
            _timed(controller, "start_writing", start_writing)
            _timed(controller, "start_loading", start_loading)
            for i in range(args.rounds):
                tokens = cache.tokens(start=1_000_000 + i * args.pages * 64, num_pages=args.pages)
                cache.insert(tokens, seed=i)
                cache.pump()
                cache.evict_device(settings.device_pool_tokens)  # all: LRU may pick others
                cache.pump()
                load = cache.load_back(tokens)
                if load.consumer_index < 0:
                    raise RuntimeError(f"round {i}: the sequence was not loaded from host")
                cache.read_device_bytes(load.device_indices)
                cache.pump()
                cache.finish(load)
                cache.evict_device(settings.device_pool_tokens)
                cache.pump()
                cache.tree_cache.evict_host(1 << 40)  # keep the host pool from filling
            print(f"{args.rounds} rounds of {args.pages}-page sequences, {args.layers} layers, "
                  f"CPU backend, through SGLang 0.5.23's controller")
            print(_figures("plug-in per write submission", writes))
            print(_figures("  of it on the scheduler's CPU", writes_cpu))
            print(_figures("plug-in per load submission", loads))
            print(_figures("  of it on the scheduler's CPU", loads_cpu))
            # start_writing runs every scheduler step; only the calls that submitted count
            submitting = sorted(start_writing, reverse=True)[:len(writes)]
            print(_figures("SGLang start_writing (whole call)", submitting))
            print(_figures("SGLang start_loading (whole call)", start_loading))
            print(_figures("pace: a cold tensor.numpy()", _cold_numpy()))
            print("(the submissions run after the scheduler thread idled in SGLang's polling; "
                  "the last line shows what one small op costs right after such a pause here)")
        finally:
            cache.close()


if __name__ == "__main__":
    main()
