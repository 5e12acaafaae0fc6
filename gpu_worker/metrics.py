"""Prometheus metrics of one worker rank. Names are a public interface (dashboards)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Step and mask times span ~10 µs (a mask row) to seconds (a long prefill on CPU).
_FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class WorkerMetrics:
    """Every metric a worker rank exports, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry):
        self.step_seconds = Histogram(
            "gramserve_worker_step_seconds", "Wall time of one engine step.",
            ["phase"], buckets=_FAST_BUCKETS, registry=registry)
        self.batch_size = Histogram(
            "gramserve_worker_batch_size", "Sequences in one step.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry)
        self.slots_in_use = Gauge(
            "gramserve_worker_slots_in_use", "Slots holding a request (pending or running).",
            registry=registry)
        self.tokens = Counter(
            "gramserve_worker_tokens_total", "Tokens processed.", ["kind"], registry=registry)
        self.releases = Counter(
            "gramserve_worker_releases_total", "Slots released, by reason.", ["reason"],
            registry=registry)
        self.tp_divergence = Counter(
            "gramserve_worker_tp_divergence_total",
            "Steps in which the ranks sampled different tokens for some slot.", registry=registry)
        self.mask_fill_seconds = Histogram(
            "gramserve_worker_mask_fill_seconds", "CPU time to fill the bitmask rows of a step.",
            buckets=_FAST_BUCKETS, registry=registry)
        self.mask_fill_exposed_seconds = Histogram(
            "gramserve_worker_mask_fill_exposed_seconds",
            "Part of the mask fill not hidden behind the forward pass.",
            buckets=_FAST_BUCKETS, registry=registry)
        self.mask_apply_seconds = Histogram(
            "gramserve_worker_mask_apply_seconds", "Time to apply the bitmask to the logits.",
            buckets=_FAST_BUCKETS, registry=registry)
        self.device_wait_seconds = Histogram(
            "gramserve_worker_device_wait_seconds",
            "Time a step's commit waited for the device to finish sampling the step before "
            "(near zero: the host's work bounds the step; most of the step: the GPU does).",
            buckets=_FAST_BUCKETS, registry=registry)
        self.step_cpu_seconds = Histogram(
            "gramserve_worker_step_cpu_seconds",
            "CPU time of the engine thread in one step. The rest of the step's wall time is "
            "waits: for the GPU (device_wait), for the mask-fill thread (mask_fill_exposed), "
            "and for the GIL while other threads of the rank hold it.",
            buckets=_FAST_BUCKETS, registry=registry)
        self.mask_fills = Counter(
            "gramserve_worker_mask_fills_total",
            "Bitmask rows filled (for sampling, forced-token checks and resamples).",
            registry=registry)
        self.forced_tokens = Counter(
            "gramserve_worker_forced_tokens_total",
            "Output tokens the grammar allowed alone: sampled (the first of a run) or taken "
            "in chains without sampling.",
            registry=registry)
        self.forced_chains = Counter(
            "gramserve_worker_forced_chains_total",
            "Chains of forced tokens taken without sampling, each fed to its row's next "
            "forward as one chunk.",
            registry=registry)
        self.forced_chain_rounds = Counter(
            "gramserve_worker_forced_chain_rounds_total",
            "Fill rounds run after a step's batch to follow forced chains in the same step "
            "(each on the critical path of its step).",
            registry=registry)
        self.accept_first_sampled = Counter(
            "gramserve_worker_accept_first_total",
            "Guided tokens sampled unmasked first (accept-first).", registry=registry)
        self.resamples = Counter(
            "gramserve_worker_resamples_total",
            "Accept-first tokens the grammar refused, resampled with the row's mask.",
            registry=registry)
        self.drafted_tokens = Counter(
            "gramserve_worker_drafted_tokens_total",
            "Guessed tokens fed after a row's newest token and checked by sampling at their "
            "positions (drafts).", registry=registry)
        self.draft_accepted = Counter(
            "gramserve_worker_draft_accepted_total",
            "Drafted tokens the row's own sample agreed with: each saves the row a step.",
            registry=registry)
        self.sampling_points = Counter(
            "gramserve_worker_sampling_points_total",
            "Sampling points (one per step with rows to sample) by how they ran: fused (one "
            "Triton pass: gather, mask, sample, checks) or op_by_op (top-k/top-p/min-p, "
            "logprobs, min_tokens rows, or fused sampling off).", ["path"], registry=registry)
        self.sampling_path = {path: self.sampling_points.labels(path=path)
                              for path in ("fused", "op_by_op")}
        self.row_forwards = Counter(
            "gramserve_worker_decode_row_forwards_total",
            "Decode rows run through a forward (one row may feed several tokens).",
            registry=registry)
        self.guided_slots = Gauge(
            "gramserve_worker_guided_slots", "Running slots with a grammar.", registry=registry)
        self.grammar_dead_ends = Counter(
            "gramserve_worker_grammar_dead_ends_total",
            "Guided requests failed because the grammar allowed no token.", registry=registry)
        self.nonfinite_logits = Counter(
            "gramserve_worker_nonfinite_logits_total",
            "Requests failed because the model gave NaN or infinite logits among the tokens "
            "they could take.", registry=registry)
        self.grammar_cache_hits = Counter(
            "gramserve_worker_grammar_cache_hits_total",
            "Compiled grammars found in the worker's local cache.", registry=registry)
        self.grammar_cache_misses = Counter(
            "gramserve_worker_grammar_cache_misses_total",
            "Compiled grammars fetched from the grammar service.", registry=registry)
        self.grammar_cache_bytes = Gauge(
            "gramserve_worker_grammar_cache_bytes",
            "Serialized bytes of the compiled grammars cached on this rank.", registry=registry)
        self.draining = Gauge(
            "gramserve_worker_draining",
            "1 while the rank's group drains (admissions refused, running requests finish).",
            registry=registry)
        self.admit_expired = Counter(
            "gramserve_worker_admit_expired_total",
            "Allocations dropped because their Admit never reached every rank.",
            registry=registry)
