"""Two py-spy collapsed-stack files of one thread, side by side: where the second spends more.

    python bench/pyspy_diff.py BASE.txt OTHER.txt [--thread engine] [--top 40]

The files are what `bench/serve.py --profile` writes (`--out/pyspy-<run>-<role>.txt`, one
line per stack: `thread (tid): name;frame;frame;... count`). Printed: the inclusive share of
samples per function (file:function, line numbers dropped) in each file and the difference,
largest increase first; then the second file's self time.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r" \((.*?):\d+\)")


def load(path: str, thread: str) -> tuple[Counter, Counter, int]:
    """(inclusive samples, self samples, total samples) per function of `thread`'s stacks."""
    inclusive, own, total = Counter(), Counter(), 0
    with open(path) as f:
        for line in f:
            if not line.startswith("thread"):
                continue
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            head, *frames = stack.split(";")
            if not head.endswith(f": {thread}"):
                continue
            n = int(count)
            total += n
            names = [_LINE.sub(r" \1", frame) for frame in frames]
            for name in set(names):
                inclusive[name] += n
            own[names[-1] if names else "?"] += n
    return inclusive, own, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--thread", default="engine")
    p.add_argument("--top", type=int, default=40)
    ns = p.parse_args(argv)
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
