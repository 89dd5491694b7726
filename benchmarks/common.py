"""Helpers shared by the benchmark scripts: machine facts, timing, the transformers reference, prompts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from sparsespec.edge.calibration.machine import loadavg  # noqa: F401  (the one definition; benchmarks import it from here)
from sparsespec.loading.fixtures import MODEL_FIXTURES

RESULTS_DIR = Path(__file__).parent / "results"


def results_dir(script: str) -> Path:
    """Where a script's records and plots go: ``results/<script's name>/`` (pass ``__file__``), one folder per script
    so that every file in it is that script's output."""
    return RESULTS_DIR / Path(script).stem

# ~130 tokens of plain prose, written for these benchmarks.
PROSE_PROMPT = (
    "The lighthouse keeper had kept a log for thirty-one years, and in all that time he had never missed a night. "
    "He wrote down the wind, the state of the sea, the ships that passed and the ones that did not. When the "
    "company finally replaced the lamp with an automatic beacon, they offered him a cottage inland and a small "
    "pension. He accepted both, packed his logbooks into four wooden crates, and left on a grey morning in March. "
    "For the first week he slept badly, waking at the hours when the lamp would have needed him. In the second "
    "week he began, without quite deciding to, to read the logs from the beginning. What he found there"
)


def source_commit() -> str:
    """The checkout's commit (short hash, "+changes" when the working tree differs from it), or "unknown"."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def machine() -> dict:
    """Facts that make a number interpretable: CPU model and family, threads, load, library versions, the commit,
    date."""
    cpu, family = "unknown", "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu == "unknown":
                cpu = value.strip()
            elif key.strip() == "cpu family" and family == "unknown":
                family = value.strip()
    except OSError:
        pass
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cpu_family": family,
        "commit": source_commit(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": loadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def median(values: list[float]) -> float:
    return statistics.median(values)


def emit(record: dict, out: Path | None) -> None:
    """Print one JSON line and append it to ``out``."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")


def fixture_path(name: str) -> Path:
    return MODEL_FIXTURES[name].path


def load_settled(*args, **kwargs):
    """``load_model(*args, **kwargs)``, then wait until the stored weights it mapped have moved into huge pages
    (``loading/huge_pages.py``), so that what a benchmark times reads the memory decoding settles on rather than
    sharing the machine with the move."""
    from sparsespec.loading.load import load_model
    from sparsespec.loading.weight_store import wait_for_huge_page_moves

    loaded = load_model(*args, **kwargs)
    wait_for_huge_page_moves()
    return loaded


def load_transformers(name: str, dtype: torch.dtype):
    """The transformers model and tokenizer for a fixture GGUF (the reference implementation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = fixture_path(name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, tokenizer


def transformers_decode_tok_s(model, prompt_ids: list[int], new_tokens: int, assistant=None) -> tuple[float, list[int]]:
    """Decode tok/s of transformers' greedy ``generate`` (prefill time removed by a 1-token run)."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        first = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - started
    return (new_tokens - 1) / max(total - first, 1e-9), out[0, len(prompt_ids):].tolist()


def dram_read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s that ``torch.sum`` streams from a buffer much larger than the last-level cache (median)."""
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - started)
    return size_bytes / median(times)
