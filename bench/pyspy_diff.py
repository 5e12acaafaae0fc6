"""Two py-spy collapsed-stack files of one thread, side by side: where the second spends more.

    python bench/pyspy_diff.py BASE.txt OTHER.txt [--thread engine] [--top 40]
    python bench/pyspy_diff.py BASE.txt OTHER.txt --steps 1582,1152 [--depth 3]

The files are what `bench/serve.py --profile` writes (`--out/pyspy-<run>-<role>.txt`, one
line per stack: `thread (tid): name;frame;frame;... count`, 250 samples a second). Printed:
the inclusive share of samples per function (file:function, line numbers dropped) in each file
and the difference, largest increase first; then the second file's self time.

`--steps`: the runs' engine steps (decode + mixed, from serve.txt's run lines); printed instead:
the engine thread's busy ms per step in each (its waits for work left out) by the call chain
below `Engine.step` (`--depth` frames, with line numbers), largest difference first. A guided
run against its unguided twin: what the grammar costs the host per step; a profile against
its `-gil` twin (`--profile-gil`): the time the thread runs without the GIL or waits for it.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r" \((.*?):\d+\)")
_FRAME = re.compile(r" \(.*?:(\d+)\)")
RATE_HZ = 250  # bench/serve.py's py-spy rate
IDLE = "SlotTable.wait_for_change"  # the engine loop waiting for work


def stacks(path: str, thread: str):
    """(frames, samples) of each stack of `thread` in a py-spy raw file."""
    with open(path) as f:
        for line in f:
            if not line.startswith("thread"):
                continue
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            head, *frames = stack.split(";")
            if head.endswith(f": {thread}"):
                yield frames, int(count)


def load(path: str, thread: str) -> tuple[Counter, Counter, int]:
    """(inclusive samples, self samples, total samples) per function of `thread`'s stacks."""
    inclusive, own, total = Counter(), Counter(), 0
    for frames, n in stacks(path, thread):
        total += n
        names = [_LINE.sub(r" \1", frame) for frame in frames]
        for name in set(names):
            inclusive[name] += n
        own[names[-1] if names else "?"] += n
    return inclusive, own, total


def per_step(path: str, steps: int, depth: int, thread: str = "engine") -> Counter:
    """Busy ms per step of the engine thread, by the `depth` frames below Engine.step."""
    out: Counter = Counter()
    for frames, n in stacks(path, thread):
        names = [_FRAME.sub(r":\1", frame) for frame in frames]
        at = next((i for i, f in enumerate(names) if f.startswith("Engine.step:")), None)
        if at is None or any(f.startswith(IDLE) for f in names):
            continue
        out[" > ".join(names[at + 1:at + 1 + depth]) or "Engine.step"] += \
            n * 1e3 / RATE_HZ / steps
    return out


def print_per_step(ns) -> None:
    steps = [int(n) for n in ns.steps.split(",")]
    a, b = (per_step(path, n, ns.depth, ns.thread)
            for path, n in zip((ns.base, ns.other), steps, strict=True))
    print(f"engine thread busy ms per step: base {sum(a.values()):.2f}, other "
          f"{sum(b.values()):.2f}, difference {sum(b.values()) - sum(a.values()):+.2f}")
    print(f"{'base':>7} {'other':>7} {'diff':>7}  call chain below Engine.step")
    for key in sorted(a.keys() | b.keys(), key=lambda k: -abs(b[k] - a[k]))[:ns.top]:
        print(f"{a[key]:7.3f} {b[key]:7.3f} {b[key] - a[key]:+7.3f}  {key}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--thread", default="engine")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--steps", default="",
                   help="BASE,OTHER: each run's engine steps; per-step busy ms instead")
    p.add_argument("--depth", type=int, default=1, help="frames below Engine.step (--steps)")
    ns = p.parse_args(argv)
    if ns.steps:
        print_per_step(ns)
        return 0
    (a, base_own, na), (b, own, nb) = load(ns.base, ns.thread), load(ns.other, ns.thread)
    if not na or not nb:
        raise SystemExit(f"no samples of thread {ns.thread!r} in one of the files")
    print(f"samples of thread {ns.thread!r}: {na}, {nb}")
    print("inclusive share: base, other, difference (points)")
    for name in sorted(set(a) | set(b), key=lambda k: a[k] / na - b[k] / nb)[:ns.top]:
        print(f"{100 * a[name] / na:6.1f}% {100 * b[name] / nb:6.1f}% "
              f"{100 * (b[name] / nb - a[name] / na):+6.1f}  {name}")
    print("self share of the other file (base, other)")
    for name, n in own.most_common(ns.top // 2):
        print(f"{100 * base_own[name] / na:6.1f}% {100 * n / nb:6.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
