"""Start-up and peak memory against llama.cpp, the same GGUF files, rounds alternated (issue: edge footprint).

Each run is a fresh process that loads the model, reads a short prompt and writes one token, then exits: its wall
time (process start to exit) and its peak resident memory (the child's ``ru_maxrss``).

* ``llama.cpp``: ``llama-simple -m FILE -n 1 PROMPT`` (its context sized to the prompt, all cores: 2 here), and
  for the 1.5B + 0.5B pair ``llama-speculative-simple -m TARGET -md DRAFT --spec-type draft-simple -n 1 -c 256
  -t 2`` (without ``--spec-type`` this build fails to start speculating).
* ``sparsespec``: ``sparsespec generate -m NAME --prompt PROMPT -n 1 --threads 2`` (``--draft`` for the pair), the
  weight store warm: each job runs once before the rounds (``warm_up`` lines; where the cache was empty, e.g. the
  baseline's, that run includes the one-off build).
* ``--baseline-src DIR``: also run another checkout's ``src`` (e.g. a ``git worktree`` of an older commit) with its
  own weight store (``--baseline-cache``), as the before of a before/after (``python -m sparsespec.cli``: before
  ``cli.entry`` existed that was what the console script ran).
* ``--cap``: then run the pair once under a hard memory cap of the two files' sizes + 25% (a memory cgroup
  created under this process's own: v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), sparsespec and the
  baseline; a process over the cap is killed by the kernel (exit 137 / signal 9).

Writes ``results/bench_startup/startup.jsonl`` (one line per run, then a summary) and
``results/bench_startup/startup.png``.

Usage::

    python benchmarks/bench_startup.py --rounds 5 --cap [--baseline-src /tmp/base/src]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import emit, fixture_path, machine, results_dir

DEFAULT_LLAMA_BIN = "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
PROMPT = "def fib(n):"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def run(cmd: list[str], env: dict | None = None, cgroup: Path | None = None) -> dict:
    """Run ``cmd`` to its end: ``{"seconds", "peak_rss_mb", "rc"}`` (rc is -9 when the kernel killed it)."""
    def enter_cgroup():
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            preexec_fn=enter_cgroup if cgroup is not None else None)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": round(seconds, 3), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "rc": proc.returncode}


def jobs(args) -> dict[tuple[str, str], tuple[list[str], dict | None]]:
    """(model, engine) → (command, environment)."""
    threads = ["--threads", str(args.threads)]
    out = {}
    for name in args.models:
        out[(name, "llama.cpp")] = ([f"{args.llama_bin}/llama-simple", "-m", str(fixture_path(name)), "-n", "1",
                                     PROMPT], None)
        ours = ["sparsespec", "generate", "-m", name, "--prompt", PROMPT, "-n", "1", *threads]
        out[(name, "sparsespec")] = (ours, None)
    target, draft = PAIR
    pair = f"{target} + {draft}"
    out[(pair, "llama.cpp")] = ([f"{args.llama_bin}/llama-speculative-simple", "-m", str(fixture_path(target)),
                                 "-md", str(fixture_path(draft)), "--spec-type", "draft-simple", "-p", PROMPT, "-n",
                                 "1", "-c", "256", "-t", str(args.threads)], None)
    out[(pair, "sparsespec")] = (["sparsespec", "generate", "-m", target, "--draft", draft, "--prompt", PROMPT,
                                  "-n", "1", *threads], None)
    if args.baseline_src:
        env = dict(os.environ, PYTHONPATH=args.baseline_src, SPARSESPEC_WEIGHT_STORE=args.baseline_cache)
        for (model, engine), (cmd, _) in list(out.items()):
            if engine == "sparsespec":  # its own checkout's command line, whatever its console script was
                out[(model, "baseline")] = ([sys.executable, "-m", "sparsespec.cli", *cmd[1:]], env)
    return out


def memory_cgroup(limit_bytes: int) -> Path | None:
    """A new memory cgroup under this process's own, capped at ``limit_bytes``; None where none can be made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, limit_file = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
        elif "memory" in controllers.split(","):
            base, limit_file = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        else:
            continue
        group = base / f"sparsespec-cap-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / limit_file).write_text(str(limit_bytes))
            if limit_file == "memory.limit_in_bytes" and (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))  # no swapping around it
            return group
        except OSError:
            continue
    return None


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def plot(summary: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(model for model, _ in summary))
    engines = list(dict.fromkeys(engine for _, engine in summary))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(engines)
    for panel, (key, label) in zip(axes, (("seconds", "start-up to one token (s)"), ("peak_rss_mb", "peak RSS (MB)"))):
        for i, engine in enumerate(engines):
            values = [summary.get((m, engine), {}).get(key, {}).get("median", 0) for m in models]
            panel.bar([x + i * width for x in range(len(models))], values, width, label=engine)
        panel.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(models))])
        panel.set_xticklabels(models, rotation=15, fontsize=8)
        panel.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("Start-up and peak memory, median of alternated rounds")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", DEFAULT_LLAMA_BIN),
                        help="folder with llama.cpp's llama-simple and llama-speculative-simple")
    parser.add_argument("--baseline-src", default=None, help="another checkout's src folder, run as 'baseline'")
    parser.add_argument("--baseline-cache", default="/tmp/sparsespec-baseline-tensors",
                        help="the baseline's weight store (default: %(default)s)")
    parser.add_argument("--cap", action="store_true", help="also run the pair under a memory cap")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "startup.jsonl")
    args = parser.parse_args()
    for binary in ("llama-simple", "llama-speculative-simple"):
        if not Path(args.llama_bin, binary).is_file():
            print(f"No {binary} in {args.llama_bin}; build llama.cpp's examples (see benchmarks/RESULTS.md) and give "
                  "--llama-bin DIR.", file=sys.stderr)
            return 2
    host = machine()
    emit({"bench": "startup", "kind": "machine", **host}, args.out)
    table = jobs(args)
    for (model, engine), (cmd, env) in table.items():  # builds where the cache is empty; files in the page cache
        if engine != "llama.cpp":
            emit({"bench": "startup", "kind": "warm_up", "model": model, "engine": engine, **run(cmd, env)},
                 args.out)
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in table}
    keys = list(table)
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            result = run(*table[key])
            runs[key].append(result)
            emit({"bench": "startup", "kind": "run", "round": r, "model": key[0], "engine": key[1], **result},
                 args.out)
    summary = {key: {"seconds": spread([x["seconds"] for x in values]),
                     "peak_rss_mb": spread([x["peak_rss_mb"] for x in values]),
                     "failed": sum(x["rc"] != 0 for x in values)} for key, values in runs.items()}
    print(f"\n{host['cpu']}, {args.threads} threads, {args.rounds} alternated rounds, median (min-max):")
    for model in dict.fromkeys(m for m, _ in summary):
        llama = summary[(model, "llama.cpp")]
        for engine in [e for m, e in summary if m == model]:
            s = summary[(model, engine)]
            ratio = s["seconds"]["median"] / llama["seconds"]["median"]
            rss_ratio = s["peak_rss_mb"]["median"] / llama["peak_rss_mb"]["median"]
            print(f"  {model:40s} {engine:11s} {s['seconds']['median']:6.2f} s ({s['seconds']['min']:.2f}-"
                  f"{s['seconds']['max']:.2f}) {ratio:5.2f}x   peak RSS {s['peak_rss_mb']['median']:7.0f} MB "
                  f"{rss_ratio:5.2f}x" + (f"  FAILED {s['failed']}" if s["failed"] else ""))
    emit({"bench": "startup", "kind": "summary", "summary": [{"model": m, "engine": e, **s}
                                                              for (m, e), s in summary.items()]}, args.out)
    plot(summary, args.out.with_suffix(".png"))
    if args.cap:
        target, draft = PAIR
        file_bytes = fixture_path(target).stat().st_size + fixture_path(draft).stat().st_size
        cap = int(file_bytes * 1.25)
        group = memory_cgroup(cap)
        if group is None:
            print("No memory cgroup could be created here (needs a writable cgroup v1 or v2 hierarchy); --cap "
                  "skipped.", file=sys.stderr)
        else:
            pair = f"{target} + {draft}"
            for engine in [e for m, e in table if m == pair]:
                result = run(*table[(pair, engine)], cgroup=group)
                print(f"  under a {cap / 2**20:.0f} MB cap (files + 25%): {engine:11s} exit {result['rc']}, "
                      f"peak RSS {result['peak_rss_mb']:.0f} MB")
                emit({"bench": "startup", "kind": "capped", "model": pair, "engine": engine, "cap_bytes": cap,
                      **result}, args.out)
            group.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
