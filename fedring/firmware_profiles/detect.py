"""Which board is this? `/proc/device-tree/model`, then `/etc/nv_tegra_release`, else generic.

The device tree names Raspberry Pis and Jetson developer kits exactly
("Raspberry Pi 4 Model B Rev 1.4", "NVIDIA Jetson Nano Developer Kit"); the RAM
variant of a Pi 4 comes from ``MemTotal`` in `/proc/meminfo`. A Jetson whose device
tree is unreadable (some containers) is recognised from the L4T release file: R32
with ``BOARD: t210ref`` is a Nano, other R32 boards are taken as Xavier NX, R35/R36
(JetPack 5/6) as an Orin Nano, the smallest Orin. All paths are parameters, so the
tests feed fake files.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedring.firmware_profiles.schema import Profile, builtin_profiles

MODEL = Path("/proc/device-tree/model")
TEGRA = Path("/etc/nv_tegra_release")
MEMINFO = Path("/proc/meminfo")
GENERIC = "generic-x86_64"


@dataclass(frozen=True)
class Detection:
    profile: Profile
    reason: str  # what was read, for `fedring profile detect` and the agent's log


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "replace").replace("\x00", "").strip()
    except OSError:
        return None


def mem_total_mb(meminfo: Path = MEMINFO) -> int | None:
    text = _read(meminfo)
    found = re.search(r"^MemTotal:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    return int(found.group(1)) // 1024 if found else None


def _tegra_name(release: str) -> str | None:
    major = re.search(r"#\s*R(\d+)", release)
    if major is None:
        return None
    if "t210" in release:  # BOARD: t210ref, Jetson Nano (L4T R32 only)
        return "jetson-nano"
    if "t186" in release or "t194" in release:  # BOARD: t186ref, Xavier (R32 and R35)
        return "jetson-xavier-nx"
    return "jetson-orin-nano" if int(major.group(1)) >= 35 else "jetson-xavier-nx"


def _family(model: str, profiles: dict[str, Any], mem: int | None) -> Detection | None:
    """A board of a known family without its own profile (Pi 400, a Compute Module, a
    Pi 3 Model B): the family's profile with the most RAM that fits MemTotal, else its
    smallest, rather than the x86 figures."""
    words = model.split()
    if len(words) < 2:
        return None
    prefix = " ".join(words[:2])  # "Raspberry Pi", "NVIDIA Jetson"
    family = [p for p in profiles.values() if p.detect_model.startswith(prefix)]
    if not family:
        return None
    # MemTotal is 90-95% of the physical RAM; on a tie, the slower board (tighter).
    fits = [p for p in family if mem is not None and p.ram_mb <= mem * 1.15]
    best = (
        max(fits, key=lambda p: (p.ram_mb, -p.gflops))
        if fits
        else min(family, key=lambda p: p.ram_mb)
    )
    why = f"{model!r} has no profile of its own: nearest {prefix} by RAM" + (
        f" (MemTotal {mem} MB)" if mem is not None else ""
    )
    return Detection(best, why)


def detect(
    model_path: Path = MODEL, tegra_path: Path = TEGRA, meminfo_path: Path = MEMINFO,
    machine: str | None = None,
) -> Detection:  # fmt: skip
    """The profile of this board; when nothing identifies it, `generic-x86_64` on x86
    and, on an ARM machine (`machine`, default `platform.machine()`), the nearest ARM
    board by RAM: never the x86 figures for an ARM CPU."""
    profiles = builtin_profiles()
    model = _read(model_path)
    if model:
        candidates = [
            p for p in profiles.values() if p.detect_model and model.startswith(p.detect_model)
        ]
        if candidates:
            mem = mem_total_mb(meminfo_path)
            if mem is not None:
                sized = [p for p in candidates if p.detect_ram_mb[0] <= mem < p.detect_ram_mb[1]]
                candidates = sized or candidates
            # Smallest RAM first: with unknown memory, assume the tightest budget.
            best = min(candidates, key=lambda p: p.ram_mb)
            why = f"{model_path}: {model!r}" + (f", MemTotal {mem} MB" if mem is not None else "")
            return Detection(best, why)
        family = _family(model, profiles, mem_total_mb(meminfo_path))
        if family is not None:
            return family
    release = _read(tegra_path)
    if release:
        name = _tegra_name(release)
        if name is not None:
            first = release.splitlines()[0]
            return Detection(profiles[name], f"{tegra_path}: {first!r}")
    why = f"no known board in {model_path} or {tegra_path}"
    arch = machine if machine is not None else platform.machine()
    if arch.lower().startswith(("aarch64", "arm")):
        return _nearest_arm(profiles, mem_total_mb(meminfo_path), f"{why}; {arch} CPU")
    return Detection(profiles[GENERIC], why)


def _nearest_arm(profiles: dict[str, Profile], mem: int | None, why: str) -> Detection:
    """An ARM board we cannot name: the ARM profile with the most RAM that fits
    MemTotal (the slower on a tie), else the smallest: a tight budget, not x86's."""
    arm = [p for p in profiles.values() if p.name != GENERIC]
    fits = [p for p in arm if mem is not None and p.ram_mb <= mem * 1.15]
    best = max(fits, key=lambda p: (p.ram_mb, -p.gflops)) if fits else min(
        arm, key=lambda p: (p.ram_mb, p.gflops))  # fmt: skip
    return Detection(best, f"{why}: nearest ARM board by RAM" + (
        f" (MemTotal {mem} MB)" if mem is not None else ""))  # fmt: skip
