"""What the machine reports about itself: CPU model and flags, cache sizes, physical memory, load average.

Read from ``/proc`` and ``/sys`` (Linux); a fact the system does not report falls back to a default (caches) or
to NaN (load)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .settings import DEFAULT_L2_PER_CORE, DEFAULT_L3, GIB, KIB, MIB


def loadavg() -> float:
    """The 1-minute load average (NaN where the OS does not report it)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def cpu_info() -> tuple[str, list[str], bool]:
    """CPU model name, feature flags and whether a hypervisor is reported, from /proc/cpuinfo."""
    name, flags = "unknown CPU", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    return name, flags, "hypervisor" in flags


def _sysfs_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", KIB), ("M", MIB), ("G", GIB)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


def cpu_cache_sizes(root: Path = Path("/sys/devices/system/cpu")) -> tuple[dict[str, int], str]:
    """CPU cache sizes from sysfs: ``cpu_l1d_per_core``, ``cpu_l2_per_core``, ``cpu_l3`` (total over instances).

    Returns the sizes and a description of where they came from; missing levels are left out.
    """
    caches: dict[str, int] = {}
    l3_instances: dict[str, int] = {}
    for cpu in sorted(root.glob("cpu[0-9]*")):
        for index in sorted((cpu / "cache").glob("index*")):
            try:
                level = int((index / "level").read_text())
                kind = (index / "type").read_text().strip()
                size = _sysfs_size((index / "size").read_text())
                shared = (index / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            if kind not in ("Data", "Unified"):
                continue
            if level == 1:
                caches.setdefault("cpu_l1d_per_core", size)
            elif level == 2:
                caches.setdefault("cpu_l2_per_core", size)
            elif level == 3:
                l3_instances[shared] = size
    if l3_instances:
        caches["cpu_l3"] = sum(l3_instances.values())
    return caches, f"{root}/cpu*/cache/index*/size"


def memory_bytes() -> int:
    """Physical memory of the machine (``sysconf(SC_PHYS_PAGES) × SC_PAGE_SIZE``)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        import psutil

        return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class Machine:
    """What the machine says about itself before any measurement."""

    date: str
    load_before: float
    cpu: str
    flags: list[str]
    hypervisor: bool
    cores: int
    threads: int
    caches: dict[str, int]
    cache_source: str

    @property
    def l2(self) -> int:
        return self.caches.get("cpu_l2_per_core", DEFAULT_L2_PER_CORE)

    @property
    def l3(self) -> int:
        return self.caches.get("cpu_l3", DEFAULT_L3)


def read_machine(threads: int) -> Machine:
    """The machine's facts now, for a calibration at ``threads`` threads."""
    cpu, flags, hypervisor = cpu_info()
    caches, cache_source = cpu_cache_sizes()
    return Machine(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), loadavg(), cpu, flags, hypervisor,
                   os.cpu_count() or 1, threads, caches, cache_source)

