"""What native weights multiply: the activations quantized to 8 bits per block, or the activations as they are.

The native kernels read a GGUF file's own blocks either way (``kernels/csrc/qmatmul.h``: activations quantized per
block, as llama.cpp does, the fastest path; ``kernels/csrc/fmatmul.h``: float activations, the arithmetic of a float
model with the file's weights). ``--activations`` chooses; torch-free, so that the command line can name the
choices before torch loads.
"""

from __future__ import annotations

from .errors import ConfigError

ACTIVATION_CHOICES = ("auto", "int8", "float")
# Under --activations auto, native models of at most this many parameters (projections and head) multiply their
# GGUF blocks with float activations, larger ones quantize the activations to 8 bits. A small model's greedy chat
# answers follow the float32 reference's much more often with float activations, for a small share of its decode
# speed; the Qwen2.5 0.5B and 1.5B follow it with 8-bit activations already, and their products are most of a step:
# benchmarks/RESULTS.md#small-model-numerics
FLOAT_ACTIVATIONS_MAX_PARAMETERS = 200_000_000


def check_activations(choice: str) -> None:
    """Refuse an ``--activations`` value that is not one of :data:`ACTIVATION_CHOICES`."""
    if choice not in ACTIVATION_CHOICES:
        raise ConfigError("{activations} must be one of {choices}, not {value!r}.",
                          choices=", ".join(ACTIVATION_CHOICES), value=choice)


def float_activations_chosen(choice: str, parameters: int) -> bool:
    """Whether native weights take float activations for ``--activations choice`` on a model of ``parameters``."""
    check_activations(choice)
    return choice == "float" or (choice == "auto" and parameters <= FLOAT_ACTIVATIONS_MAX_PARAMETERS)
