"""Summarize py-spy ``--format raw`` profiles (``record --threads --native [--idle]``): per thread, where samples end.

``python -m bench.serving.stacks FILE...`` prints, for each file and each thread with at least 2% of the file's samples,
the share of samples in each category (waiting for the GIL, idle in epoll or on a queue, CUDA calls, socket
I/O, memcpy; else the innermost Python function) and the innermost Python functions that took the most samples.
Used by bench/device/profile_service.sh.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

# (category, pattern on one frame), tried from the leaf to the root; the first frame that matches decides.
RULES: list[tuple[str, re.Pattern[str]]] = [
    # CPython's GIL waits on a condition variable with a timeout; its locks (queues, events) use semaphores.
    ("GIL wait", re.compile(r"^(take_gil|pthread_cond_timedwait|PyEval_RestoreThread|PyEval_AcquireThread) ")),
    ("idle: epoll", re.compile(r"^epoll_p?wait ")),
    ("idle: queue/lock", re.compile(r"^(PyThread_acquire_lock\w*|_queue_SimpleQueue_get_impl|SimpleQueue\.get) ")),
    ("CUDA sync", re.compile(r"Synchronize|^cuStreamQuery|^cudaStreamQuery")),
    ("CUDA copy/launch", re.compile(r"^(cudaMemcpy|cuMemcpy|cudaLaunch|cuLaunch|cudaHostAlloc|cuMemHostAlloc)")),
    ("socket write", re.compile(r"^(writev|__writev|sendmsg|__sendmsg|__libc_write|write) \(libc")),
    ("socket read", re.compile(r"^(recv|__libc_recv|recvmsg|__libc_read|read) \(libc")),
    ("memcpy", re.compile(r"^__?mem(cpy|move)")),
]
PY_FRAME = re.compile(r"^(\S+) \((\S+\.py):\d+\)$")


def categorize(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in RULES:
            if pattern.search(frame):
                return name
    return "Python/other: " + innermost_python(frames)


def innermost_python(frames: list[str]) -> str:
    for frame in reversed(frames):
        m = PY_FRAME.match(frame)
        if m:
            return f"{m.group(1)} ({Path(m.group(2)).name})"
    return frames[-1] if frames else "?"


def summarize(path: Path, top: int) -> None:
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    pyself: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        head, _, rest = stack.partition(";")
        thread = re.sub(r"^thread \(\d+\): ", "", head)
        thread = re.sub(r"-\d+$", "", thread)  # worker threads by name, whatever their generation
        frames = rest.split(";") if rest else []
        threads[thread][categorize(frames)] += n
        pyself[thread][innermost_python(frames)] += n
        total += n
    print(f"\n#### {path.name}: {total} samples")
    for thread, cats in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        t = sum(cats.values())
        if t < 0.02 * total:
            continue
        print(f"-- thread {thread}: {t} samples")
        for name, n in cats.most_common(top):
            print(f"   {100 * n / t:5.1f}%  {name}")
        busy = [(k, v) for k, v in pyself[thread].most_common() if "epoll" not in k]
        print("   innermost Python frames: " + ", ".join(f"{k} {100 * v / t:.1f}%" for k, v in busy[:top]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.files:
        if path.exists():
            summarize(path, args.top)


if __name__ == "__main__":
    main()
