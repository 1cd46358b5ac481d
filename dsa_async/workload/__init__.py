"""A serving-like workload that drives an ``OffloadService`` the way an inference engine would.

Conversations with shared system prompts arrive over time (a seeded model or a replayed
trace); each turn appends tokens to its conversation's pages on the "device"; a device-side
LRU backs pages up to the host pool when the device cache runs short; a returning
conversation's pages are prefetched into free device pages ahead of a forward-pass thread that
waits for them layer by layer. Every page carries a checksum of what was written on the device,
and every prefetched page is checked against it once its load completes.

Modules, one role each:

=================  ==============================================================
``conversations``  arrival model (seeded) and trace replay: what arrives, when
``pagedata``       deterministic page contents and per-page checksums
``segments``       a run of a conversation's (or a shared prompt's) pages, its states
``device_cache``   device page table: free pages and the LRU of evictable segments
``host_cache``     host handles: LRU, in-flight holds, release under pressure
``consumer``       the forward-pass thread: per-layer waits, compute, writes, checks
``engine``         the loop side: admission, eviction, prefetch, completion, drain
``counters``       what the workload counted (loop thread only)
``status``         the live status line or periodic log line
``summary``        the frozen end-of-run summary, its text and JSON forms
``runner``         one run: buffers, service, metrics server, signals, drain, summary
=================  ==============================================================
"""
