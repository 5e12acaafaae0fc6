"""`python -m gpu_worker ...` (= `gramserve worker`): one tensor-parallel rank."""

import os
import sys

from gpu_worker.config import WorkerConfig


def _run() -> int:
    try:
        cfg = WorkerConfig.from_args(sys.argv[1:])
    except ValueError as exc:
        print(f"gramserve worker: {exc}", file=sys.stderr)
        return 2
    if cfg.device == "cpu" or (cfg.device == "auto" and not _cuda()):
        # Triton runs on CPU tensors only through its interpreter; it must be chosen before
        # triton is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from gpu_worker.control.server import main

    return main(sys.argv[1:])


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


sys.exit(_run())
