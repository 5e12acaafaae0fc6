"""The OpenAI-compatible HTTP front against the gRPC API: one stack, the same load, side by side.

The checkpoint and stack of bench/serve.py (a random-weight Qwen2.5-0.5B-shaped model, bf16,
with a 150k-token byte-level BPE; `gramserve up`, TP=1, 256 slots, 4 gateways, each serving
gRPC and HTTP), driven by `gramserve bench` at one concurrency with 0 % and 100 % of the
requests guided (the short schema family, the backend chosen automatically: the HTTP API has
no backend field), each row run through gRPC and then through HTTP (`gramserve bench --http`:
streamed /v1/completions through the official openai SDK), in `--rounds` alternating rounds.
Prints each run and a table of HTTP ÷ gRPC output tokens/s (the issue's target: >= 0.95).

    PYTHONPATH=$PWD python bench/http_front.py --tokenizer .bench/tok150k.json --out $OUT
    PYTHONPATH=$PWD python bench/http_front.py --device cpu --tiny      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve import Stack, cpu_seconds, roles, run_load, say  # noqa: E402
from gateway.launcher import free_ports  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, default "
                   "model's tokenizer, 8 slots, concurrency 4, 2 s runs")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (150k BPE)")
    p.add_argument("--out", type=Path, default=None, help="directory for http_front.txt/json")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--ratios", default="0,1.0")
    p.add_argument("--family", default="short")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--gateways", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    ns = p.parse_args(argv)
    ns.ratios = [float(r) for r in ns.ratios.split(",")]
    ns.backend = "auto"
    if ns.tiny:
        ns.slots, ns.concurrency, ns.duration, ns.gateways = 8, 4, 2.0, 1
        ns.client_processes, ns.max_tokens = 1, 16
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.device == "cpu":  # the worker's Triton kernels run interpreted on the CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if ns.tokenizer is None and not ns.tiny:
        raise SystemExit("--tokenizer PATH is required without --tiny")
    out = ns.out or Path(tempfile.mkdtemp(prefix="http-front-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="http-front-model-") as tmp:
        return run(ns, Path(tmp), out)


def run(ns, model_dir: Path, out: Path) -> int:
    import torch

    from bench.step import QWEN25_05B, TINY, add_tokenizer, write_checkpoint
    from grammar_service.default_model import ensure_default_model

    lines: list[str] = []

    def say_line(msg: str) -> None:
        say(msg)
        lines.append(msg)

    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    tokenizer = ns.tokenizer or ensure_default_model() / "tokenizer.json"
    shape = dict(QWEN25_05B)
    if ns.tiny:
        from tokenizers import Tokenizer

        n = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        shape = dict(TINY, vocab_size=math.ceil(n / 64) * 64)
    del_hf = write_checkpoint(model_dir, shape, dtype, torch.device("cpu"))
    del del_hf
    add_tokenizer(model_dir, tokenizer)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               GRAMSERVE_CUDA_GRAPH_MAX_BATCH=str(ns.slots))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    port = free_ports(1, set())
    url = f"http://127.0.0.1:{port}"
    stack = Stack(["--device", ns.device, "--tp", "1", "--slots", str(ns.slots),
                   "--gateways", str(ns.gateways), "--http-port", str(port),
                   "--model", str(model_dir), "--port", "0", "--metrics-port", "0",
                   "--max-model-len", str(ns.max_model_len),
                   "--max-queue", str(max(64, 2 * ns.concurrency)),
                   "--startup-timeout", str(ns.startup_timeout)], env, out / "stack.log")
    runs = []
    c = ns.concurrency
    try:
        addr = stack.start(ns.startup_timeout + 30)
        say_line(f"stack up at {addr}, HTTP {url}; {ns.device}, {ns.slots} slots, "
                 f"{ns.gateways} gateways, concurrency {c}, {ns.max_tokens} max tokens, "
                 f"{ns.duration:g} s runs, {ns.rounds} rounds, family {ns.family}, backend auto")
        for front in ("grpc", "http"):  # compiles every schema, captures the decode graphs
            warm = run_load(addr, c, ns.family, 0.5, ns, duration=0, requests=2 * c,
                            http=url if front == "http" else "")
            say_line(f"warm-up {front}: {warm['ok']}/{warm['requests']} ok, errors "
                     f"{warm['errors']}")
        pids = roles(stack.proc.pid)
        for k in range(ns.rounds):
            for ratio in ns.ratios:
                for front in ("grpc", "http"):
                    cpu0, t0 = cpu_seconds(pids), time.monotonic()
                    s = run_load(addr, c, ns.family, ratio, ns, duration=ns.duration,
                                 http=url if front == "http" else "")
                    wall, cpu1 = time.monotonic() - t0, cpu_seconds(pids)
                    gw = sum(cpu1[r] - cpu0.get(r, 0.0) for r in cpu1
                             if r.startswith("gateway")) / wall
                    runs.append({"round": k, "ratio": ratio, "front": front,
                                 "gateway_cores": gw, **s})
                    say_line(f"round {k} ratio {ratio:g} {front}: "
                             f"{s['output_tokens_per_second']:,.0f} tok/s, "
                             f"{s['ok']}/{s['requests']} ok, errors {s['errors']}, TTFT p50 "
                             f"{s['ttft_seconds']['p50'] * 1e3:.1f} ms, inter-token p50 "
                             f"{s['inter_token_seconds']['p50'] * 1e3:.2f} ms, schema-valid "
                             f"{s['schema_valid_rate']}, gateway cores {gw:.2f}")
    finally:
        stack.stop()
    text = table(runs, ns)
    print(text)
    (out / "http_front.txt").write_text("\n".join(lines) + "\n\n" + text + "\n")
    (out / "http_front.json").write_text(json.dumps(runs, indent=1))
    return 0 if runs else 1


def table(runs: list[dict], ns) -> str:
    rows = ["| guided | gRPC tok/s | HTTP tok/s | HTTP ÷ gRPC | TTFT p50 ms gRPC / HTTP | "
            "inter-token p50 ms gRPC / HTTP | errors | gateway cores gRPC / HTTP |",
            "|---|---|---|---|---|---|---|---|"]
    for ratio in ns.ratios:
        by = {f: [r for r in runs if r["ratio"] == ratio and r["front"] == f]
              for f in ("grpc", "http")}
        if not by["grpc"] or not by["http"]:
            continue

        def mean(f, key, sub=None, by=by):
            return statistics.mean(r[key][sub] if sub else r[key] for r in by[f])

        g, h = mean("grpc", "output_tokens_per_second"), mean("http", "output_tokens_per_second")
        errors = sum(sum(r["errors"].values()) for f in by for r in by[f])
        rows.append(
            f"| {ratio:.0%} | {g:,.0f} | {h:,.0f} | {h / g:.3f} | "
            f"{mean('grpc', 'ttft_seconds', 'p50') * 1e3:.1f} / "
            f"{mean('http', 'ttft_seconds', 'p50') * 1e3:.1f} | "
            f"{mean('grpc', 'inter_token_seconds', 'p50') * 1e3:.2f} / "
            f"{mean('http', 'inter_token_seconds', 'p50') * 1e3:.2f} | {errors} | "
            f"{mean('grpc', 'gateway_cores'):.2f} / {mean('http', 'gateway_cores'):.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
