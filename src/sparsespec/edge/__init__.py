"""The edge simulator: device profiles as data and an analytical roofline + SRAM-residency model of decoding.

- :mod:`.profile` — :class:`DeviceProfile`, ``load_profile`` / ``list_profiles`` / ``save_profile``; the shipped
  profiles live in ``devices/*.json``, each figure with its source.
- :mod:`.roofline` — bytes per memory level, FLOPs and time of a forward pass; per-token predictions for the
  ``full``, ``sparse``, ``speculative`` and ``combined`` modes; best γ and budget on a device. The speculative-decoding
  formulas are the decoding core's (:mod:`sparsespec.speedup`), re-exported here.
- :mod:`.commands` — the ``sparsespec simulate`` command.

Nothing here imports torch, so the simulator runs anywhere Python does.
"""

from ..speedup import best_gamma, expected_tokens_per_pass, speculative_speedup
from .profile import DeviceProfile, list_profiles, load_profile, save_profile
from .roofline import (
    MODES,
    PassCost,
    Prediction,
    best_budget,
    best_gamma_on_device,
    forward_pass,
    kv_bytes_per_token,
    predict,
    predict_autoregressive,
    predict_combined,
    predict_sparse,
    predict_speculative,
)

__all__ = [
    "MODES",
    "DeviceProfile",
    "PassCost",
    "Prediction",
    "best_budget",
    "best_gamma",
    "best_gamma_on_device",
    "expected_tokens_per_pass",
    "forward_pass",
    "kv_bytes_per_token",
    "list_profiles",
    "load_profile",
    "predict",
    "predict_autoregressive",
    "predict_combined",
    "predict_sparse",
    "predict_speculative",
    "save_profile",
    "speculative_speedup",
]
