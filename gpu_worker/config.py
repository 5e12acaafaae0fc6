"""Configuration of one worker rank: flags with GRAMSERVE_* environment defaults.

Plain Python (no torch): `python -m gpu_worker` parses it before anything imports Triton, so
the CPU device can switch Triton to its interpreter first.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from protos.rpc import env_default

# Drafted tokens per row where --draft-tokens is left to the device (gpu_worker.guided.drafts).
DRAFT_TOKENS_CUDA = 2


def draft_tokens_on(draft_tokens: int, device_type: str) -> int:
    """The drafted tokens per row a rank uses: the setting, or for -1 (auto) the CUDA default
    on a GPU and none on CPU (a CPU forward costs in proportion to the tokens it feeds; no
    gain measured there: bench/drafts_engine.py)."""
    if draft_tokens >= 0:
        return draft_tokens
    return DRAFT_TOKENS_CUDA if device_type == "cuda" else 0


@dataclass(frozen=True)
class WorkerConfig:
    rank: int
    tp: int
    dist_addr: str
    host: str
    port: int
    model: str
    grammar_service: str
    device: str
    dtype: str
    slots: int
    max_model_len: int
    step_tokens: int
    metrics_port: int
    admit_timeout_s: float
    grammar_fetch_timeout_s: float
    collective_timeout_s: float
    divergence_check_every: int
    grammar_cache_bytes: int
    torch_threads: int
    cuda_graph_max_tokens: int
    mask_fill_threads: int
    forced_tokens: bool
    accept_first: bool
    tls_cert: str
    tls_key: str
    tls_ca: str
    tls_client_ca: str = ""
    metrics_host: str = "127.0.0.1"
    reflection: str = "on"
    drain_timeout_s: float = 30.0
    forced_round_cost: float = 1 / 16
    draft_tokens: int = -1  # -1: DRAFT_TOKENS_CUDA on CUDA, 0 on CPU (`draft_tokens_on`)
    fused_sampling: str = "auto"  # auto: on CUDA (gpu_worker.sampling.kernel.sample_rows)
    gpu_offset: int = 0  # CUDA: rank r runs on visible device (gpu_offset + r) mod count

    def __post_init__(self):
        checks = [
            (self.tp >= 1, "tp", "must be >= 1"),
            (0 <= self.rank < self.tp, "rank", f"must be in [0, {self.tp})"),
            (self.tp == 1 or ":" in self.dist_addr, "dist-addr", "must be HOST:PORT when tp > 1"),
            (self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
             "must be auto, float32, bfloat16 or float16"),
            (self.slots >= 1, "slots", "must be >= 1"),
            (self.fused_sampling in ("auto", "on", "off"), "fused-sampling",
             "must be auto, on or off"),
            (self.max_model_len >= 2, "max-model-len", "must be >= 2"),
            (self.step_tokens >= self.slots, "step-tokens", "must be >= --slots"),
            (self.grammar_fetch_timeout_s > 0, "grammar-fetch-timeout", "must be > 0"),
            # A follower rank fetches its grammar after rank 0 has allocated the slot, so the
            # admission must be able to outlast the slowest fetch.
            (self.admit_timeout_s > self.grammar_fetch_timeout_s, "admit-timeout",
             f"must be greater than --grammar-fetch-timeout ({self.grammar_fetch_timeout_s:g} "
             "s): a rank fetching its grammar must never see the admission expire"),
            (self.collective_timeout_s > 0, "collective-timeout", "must be > 0"),
            (self.divergence_check_every >= 0, "divergence-check-every", "must be >= 0"),
            (self.cuda_graph_max_tokens >= 0, "cuda-graph-max-tokens", "must be >= 0"),
            (self.mask_fill_threads >= 0, "mask-fill-threads", "must be >= 0"),
            (self.grammar_cache_bytes > 0, "grammar-cache-bytes", "must be > 0"),
            (bool(self.tls_cert) == bool(self.tls_key), "tls-cert", "needs --tls-key (and back)"),
            (not self.tls_client_ca or bool(self.tls_cert), "tls-client-ca",
             "needs --tls-cert and --tls-key (mutual TLS is TLS first)"),
            (self.reflection in ("on", "off"), "reflection", "must be on or off"),
            (self.drain_timeout_s >= 0, "drain-timeout", "must be >= 0"),
            (self.forced_round_cost >= 0, "forced-round-cost", "must be >= 0"),
            (-1 <= self.draft_tokens <= 8, "draft-tokens", "must be in [0, 8], or -1 (auto)"),
            (self.gpu_offset >= 0, "gpu-offset", "must be >= 0"),
        ]
        for ok, flag, why in checks:
            if not ok:
                raise ValueError(f"--{flag} {why}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> WorkerConfig:
        """Parse flags (GRAMSERVE_<FLAG> env vars as defaults); ValueError names a bad flag."""
        args = parser().parse_args(argv)
        return cls(**{k: v for k, v in vars(args).items()})


def cuda_device_index(rank: int, tp: int, offset: int, count: int) -> int:
    """The visible CUDA device of TP rank `rank`: (offset + rank) modulo `count`. The ranks of
    one group must sit on distinct devices (NCCL refuses two ranks on one), so a group of more
    ranks than visible devices raises ValueError naming --tp."""
    if count < 1:
        raise ValueError("--device cuda: no CUDA device is visible")
    if tp > count:
        raise ValueError(f"--tp {tp} needs {tp} CUDA devices, {count} visible: each rank of a "
                         "group runs on its own device")
    return (offset + rank) % count


def _flag(text) -> bool:
    """A boolean from a GRAMSERVE_<FLAG> value: 1/0, true/false, yes/no, on/off."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gramserve worker", description="One tensor-parallel rank.")
    e = env_default
    p.add_argument("--rank", type=int, default=e("rank", 0), help="this process's TP rank")
    p.add_argument("--tp", type=int, default=e("tp", 1), help="ranks in the TP group")
    p.add_argument("--dist-addr", default=e("dist_addr", "127.0.0.1:29500"),
                   help="HOST:PORT rendezvous of the group (rank 0 listens there)")
    p.add_argument("--host", default=e("host", "127.0.0.1"), help="gRPC bind address")
    p.add_argument("--port", type=int, default=e("port", 50060), help="gRPC port (0 = any)")
    p.add_argument("--model", default=e("model", ""),
                   help="Hugging Face checkpoint directory; empty = the embedded default model")
    p.add_argument("--grammar-service", default=e("grammar_service", "127.0.0.1:50052"),
                   help="HOST:PORT of the grammar service")
    p.add_argument("--device", default=e("device", "auto"), help="auto, cpu or cuda")
    p.add_argument("--dtype", default=e("dtype", "auto"),
                   help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--slots", type=int, default=e("slots", 8), help="concurrent requests")
    p.add_argument("--max-model-len", type=int, default=e("max_model_len", 1024),
                   help="most tokens (prompt + output) per slot")
    p.add_argument("--step-tokens", type=int, default=e("step_tokens", 512),
                   help="token budget of one step (decode tokens + prefill chunks)")
    p.add_argument("--metrics-port", type=int, default=e("metrics_port", -1),
                   help="Prometheus /metrics port; -1 = off, 0 = any")
    p.add_argument("--admit-timeout", dest="admit_timeout_s", type=float,
                   default=e("admit_timeout", 60.0),
                   help="seconds rank 0's slot allocation waits for every other rank's Admit "
                        "before it expires; must exceed --grammar-fetch-timeout")
    p.add_argument("--grammar-fetch-timeout", dest="grammar_fetch_timeout_s", type=float,
                   default=e("grammar_fetch_timeout", 45.0),
                   help="deadline of one grammar fetch from the grammar service, which may "
                        "recompile an evicted grammar: keep it above the service's "
                        "--compile-timeout")
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=float,
                   default=e("collective_timeout", 30.0),
                   help="seconds before a collective with a silent peer fails the rank")
    p.add_argument("--divergence-check-every", type=int, default=e("divergence_check_every", 1),
                   help="compare sampled ids across ranks every K steps (0 = never)")
    p.add_argument("--grammar-cache-bytes", type=int, default=e("grammar_cache_bytes", 256 << 20),
                   help="byte bound of this rank's compiled-grammar cache")
    p.add_argument("--torch-threads", type=int, default=e("torch_threads", 0),
                   help="CPU threads for torch (0 = cores / tp)")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=e("cuda_graph_max_tokens", 512),
                   help="CUDA: replay steps of up to this many new tokens (decode and prefill "
                        "alike) from CUDA graphs captured at start-up (0 = eager)")
    p.add_argument("--mask-fill-threads", type=int, default=e("mask_fill_threads", 0),
                   help="threads filling the guided rows' bitmasks (0 = one per core)")
    p.add_argument("--forced-tokens", action=argparse.BooleanOptionalAction,
                   type=_flag, default=e("forced_tokens", True),
                   help="after two forced tokens in a row, take the rest of the chain of "
                        "tokens the grammar allows alone without sampling, in one step (same "
                        "output; --no-forced-tokens turns it off)")
    p.add_argument("--forced-round-cost", type=float, default=e("forced_round_cost", 1 / 16),
                   help="what a fill round that follows forced chains within a step costs, as "
                        "a share of a step: a round runs only where the rows taking forced "
                        "tokens, times how often such a token was followed by another, reach "
                        "this share of the batch's rows (0 = always follow a chain at once)")
    p.add_argument("--accept-first", action=argparse.BooleanOptionalAction,
                   type=_flag, default=e("accept_first", True),
                   help="sample greedy and temperature-only guided rows unmasked first and "
                        "mask only refused ones (same output; --no-accept-first turns it off)")
    p.add_argument("--draft-tokens", type=int, default=e("draft_tokens", -1),
                   help="accept-first rows feed up to this many tokens guessed from earlier "
                        "outputs of their grammar after their newest one, and keep the "
                        "samples that agree: fewer steps, the same output (0 = off; -1, the "
                        f"default: {DRAFT_TOKENS_CUDA} on CUDA, 0 on CPU, where a forward "
                        "costs in proportion to the tokens it feeds)")
    p.add_argument("--fused-sampling", default=e("fused_sampling", "auto"),
                   choices=("auto", "on", "off"),
                   help="sample a step's rows in one fused Triton pass (mask, padded ids, "
                        "Gumbel-max, the commit's checks) where every row samples with "
                        "temperature only: the same tokens with far fewer launches (auto: on "
                        "CUDA; on the CPU it needs TRITON_INTERPRET=1 and is slow)")
    p.add_argument("--gpu-offset", type=int, default=e("gpu_offset", 0),
                   help="CUDA: rank r of the group runs on visible device (offset + r) modulo "
                        "the number visible; `gramserve up` gives group g the offset g * tp, "
                        "so groups spread over the host's GPUs and share them when fewer")
    p.add_argument("--tls-cert", default=e("tls_cert", ""), help="server certificate PEM file")
    p.add_argument("--tls-key", default=e("tls_key", ""), help="server private key PEM file")
    p.add_argument("--tls-ca", default=e("tls_ca", ""),
                   help="CA PEM file for the connection to the grammar service (this rank "
                        "presents --tls-cert/--tls-key to it, for mutual TLS)")
    p.add_argument("--tls-client-ca", default=e("tls_client_ca", ""),
                   help="CA PEM file client certificates must be signed by: mutual TLS, "
                        "plaintext and other certificates refused")
    p.add_argument("--metrics-host", default=e("metrics_host", "127.0.0.1"),
                   help="bind address of /metrics (loopback unless set)")
    p.add_argument("--reflection", default=e("reflection", "on"), choices=("on", "off"),
                   help="gRPC server reflection")
    p.add_argument("--drain-timeout", dest="drain_timeout_s", type=float,
                   default=e("drain_timeout", 30.0),
                   help="on SIGTERM the whole group drains: health NOT_SERVING, admissions "
                        "refused with UNAVAILABLE, running requests finish for up to this many "
                        "seconds (then fail with UNAVAILABLE), and every rank exits 0")
    return p
