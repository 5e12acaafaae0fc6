"""Where a rank's engine thread spends a step: two py-spy profiles side by side, per step.

    python bench/pyspy_steps.py --steps 1168 pyspy-on-r1-c64-long-1-rank0.txt \
        --vs-steps 1636 pyspy-on-r1-c64-long-1-twin-rank0.txt [--depth 2] [--top 30]

The profiles are `bench/serve.py --profile` output (py-spy raw, 250 samples/s, idle samples
kept); the step counts are the run's worker steps (`step_seconds:decode_steps` plus
`mixed_steps` in serve.txt's run lines). Printed: the engine thread's busy ms per step (idle
waits for work left out) of each profile and their difference, by the call chain below
`Engine.step` (to `--depth` frames, with line numbers), largest difference first. A guided run
against its unguided twin shows what the grammar costs the host per step.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_FRAME = re.compile(r" \(.*?:(\d+)\)")
RATE_HZ = 250  # bench/serve.py's py-spy rate
IDLE = ("SlotTable.wait_for_change",)  # the loop waiting for work


def per_step(path: Path, steps: int, depth: int) -> collections.Counter:
    """ms per step of the engine thread, by the `depth` frames below Engine.step."""
    out: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames[0].endswith(": engine"):
            continue
        names = [_FRAME.sub(r":\1", f) for f in frames[1:]]
        at = next((i for i, f in enumerate(names) if f.startswith("Engine.step:")), None)
        if at is None or any(f.startswith(IDLE) for f in names):
            continue
        key = " > ".join(names[at + 1:at + 1 + depth]) or "Engine.step"
        out[key] += int(count) * 1e3 / RATE_HZ / steps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path)
    p.add_argument("vs", type=Path)
    p.add_argument("--steps", type=int, required=True, help="steps of the first profile's run")
    p.add_argument("--vs-steps", type=int, required=True, help="steps of the second's")
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--top", type=int, default=30)
    ns = p.parse_args(argv)
    a, b = per_step(ns.profile, ns.steps, ns.depth), per_step(ns.vs, ns.vs_steps, ns.depth)
    print(f"engine thread busy ms per step: {sum(a.values()):.2f} ({ns.profile.name}) vs "
          f"{sum(b.values()):.2f} ({ns.vs.name}), difference {sum(a.values()) - sum(b.values()):+.2f}")
    print(f"{'first':>7} {'second':>7} {'diff':>7}  call chain below Engine.step")
    for key in sorted(a.keys() | b.keys(), key=lambda k: -abs(a[k] - b[k]))[:ns.top]:
        print(f"{a[key]:7.3f} {b[key]:7.3f} {a[key] - b[key]:+7.3f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
