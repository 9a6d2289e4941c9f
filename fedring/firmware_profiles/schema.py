"""`Profile`: one board's figures, loaded from a TOML file and checked field by field.

Every field has a type and a range; a key the schema does not know is refused,
and every error names the field by its dotted path (``links.wifi.bandwidth_mbps``)
and the bad value. The files in ``data/`` cite a public source for every figure.

    >>> p = load_builtin("rpi4-4gb")
    >>> p.cores, p.link().name
    (4, 'wifi')
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

DTYPES = ("fp32", "fp16", "bf16")
VALUE_DTYPES = ("fp32", "fp16", "bf16", "int8")
COMPRESSIONS = ("none", "group-topk")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Link:
    name: str  # "wifi" or "ethernet"
    bandwidth_mbps: float  # sustained TCP goodput of this link, Mbit/s
    latency_ms: float  # one-way latency to the broker on the LAN, ms
    shared_medium: bool  # Wi-Fi: every agent on the channel shares the airtime


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    aliases: tuple[str, ...]
    detect_model: str  # prefix of /proc/device-tree/model ("" = never matched by model)
    detect_ram_mb: tuple[int, int]  # MemTotal range that picks this RAM variant
    cores: int
    gflops: float  # sustained CPU throughput (fedring trains on the CPU today)
    gpu_gflops: float  # peak fp32 of the GPU, 0 when none (informational until CUDA training)
    ram_mb: int  # physical RAM
    ram_budget_mb: int  # what one job's tensors and data may take
    links: Mapping[str, Link]
    default_link: str
    torch_threads: int
    batch_size: int
    dtype: str  # training dtype
    compression: str
    density: float
    group_size: int
    value_dtype: str
    max_frame_bytes: int
    keepalive_s: int
    round_deadline_s: float
    onnx_providers: tuple[str, ...]
    source: str = field(default="", compare=False)  # the file it came from

    def link(self, name: str | None = None) -> Link:
        """The named link (or the default one); ProfileError when the board lacks it."""
        key = name or self.default_link
        if key not in self.links:
            raise ProfileError(
                f"profile {self.name!r} has no {key!r} link; it has {', '.join(self.links)}"
            )
        return self.links[key]


# (dotted key, type, low, high): the whole schema. A range of None means any value.
_NUM = (int, float)
_SCHEMA: dict[str, tuple[type | tuple[type, ...], float | None, float | None]] = {
    "name": (str, None, None),
    "description": (str, None, None),
    "aliases": (list, None, None),
    "default_link": (str, None, None),
    "detect.model": (str, None, None),
    "detect.ram_mb": (list, None, None),
    "compute.cores": (int, 1, 1024),
    "compute.gflops": (_NUM, 0.01, 1e6),
    "compute.gpu_gflops": (_NUM, 0.0, 1e7),
    "compute.ram_mb": (int, 64, 1 << 24),
    "compute.ram_budget_mb": (int, 16, 1 << 24),
    "training.torch_threads": (int, 1, 1024),
    "training.batch_size": (int, 1, 1 << 16),
    "training.dtype": (str, None, None),
    "compression.compression": (str, None, None),
    "compression.density": (_NUM, 1e-6, 1.0),
    "compression.group_size": (int, 1, 65536),
    "compression.value_dtype": (str, None, None),
    "runtime.max_frame_bytes": (int, 8192, 1 << 28),  # wire.frame.Limits needs >= 8 KiB
    "runtime.keepalive_s": (int, 2, 600),
    "runtime.round_deadline_s": (_NUM, 0.1, 86400.0),
    "runtime.onnx_providers": (list, None, None),
}
_LINK: dict[str, tuple[type | tuple[type, ...], float | None, float | None]] = {
    "bandwidth_mbps": (_NUM, 0.01, 1e6),
    "latency_ms": (_NUM, 0.0, 60000.0),
    "shared_medium": (bool, None, None),
}
_CHOICES = {
    "training.dtype": DTYPES,
    "compression.compression": COMPRESSIONS,
    "compression.value_dtype": VALUE_DTYPES,
}


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path != "links" and not path.startswith("links."):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _check(where: str, path: str, value: Any, rule: tuple[Any, float | None, float | None]) -> Any:
    kind, low, high = rule
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if not ok:
        names = "/".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise ProfileError(f"{where}: field {path!r}={value!r} must be {names}")
    if low is not None and high is not None and not low <= value <= high:
        raise ProfileError(f"{where}: field {path!r}={value!r} must be in [{low}, {high}]")
    if path in _CHOICES and value not in _CHOICES[path]:
        raise ProfileError(
            f"{where}: field {path!r}={value!r} must be one of {', '.join(_CHOICES[path])}"
        )
    return value


def _links(where: str, table: Any) -> dict[str, Link]:
    if not isinstance(table, dict) or not table:
        raise ProfileError(f"{where}: field 'links' must hold at least one [links.NAME] table")
    links = {}
    for name, spec in table.items():
        if name not in ("wifi", "ethernet"):
            raise ProfileError(f"{where}: unknown field 'links.{name}' (wifi or ethernet)")
        if not isinstance(spec, dict):
            raise ProfileError(f"{where}: field 'links.{name}' must be a table")
        for key in spec.keys() - _LINK.keys():
            raise ProfileError(f"{where}: unknown field 'links.{name}.{key}'")
        for key in _LINK.keys() - spec.keys():
            raise ProfileError(f"{where}: missing field 'links.{name}.{key}'")
        vals = {k: _check(where, f"links.{name}.{k}", spec[k], _LINK[k]) for k in _LINK}
        links[name] = Link(name, float(vals["bandwidth_mbps"]), float(vals["latency_ms"]),
                           vals["shared_medium"])  # fmt: skip
    return links


def _str_list(where: str, path: str, value: list[Any], length: int | None = None) -> list[Any]:
    if length is None and not all(isinstance(v, str) for v in value):
        raise ProfileError(f"{where}: field {path!r}={value!r} must be a list of strings")
    if length is not None and (
        len(value) != length
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        or value[0] >= value[1]
    ):
        raise ProfileError(
            f"{where}: field {path!r}={value!r} must be [low, high] in MB with low < high"
        )
    return value


def parse_profile(data: Mapping[str, Any], where: str) -> Profile:
    """Validate a profile table (as read from TOML); `where` names it in errors."""
    flat = _flatten(data)
    links = _links(where, flat.pop("links", None))
    for key in sorted(flat.keys() - _SCHEMA.keys()):
        raise ProfileError(f"{where}: unknown field {key!r}")
    for key in sorted(_SCHEMA.keys() - flat.keys()):
        raise ProfileError(f"{where}: missing field {key!r}")
    v = {k: _check(where, k, flat[k], rule) for k, rule in _SCHEMA.items()}
    ram = _str_list(where, "detect.ram_mb", v["detect.ram_mb"], length=2)
    if v["compute.ram_budget_mb"] > v["compute.ram_mb"]:
        raise ProfileError(
            f"{where}: field 'compute.ram_budget_mb'={v['compute.ram_budget_mb']} exceeds "
            f"compute.ram_mb={v['compute.ram_mb']}"
        )
    if v["default_link"] not in links:
        raise ProfileError(
            f"{where}: field 'default_link'={v['default_link']!r} is not one of {', '.join(links)}"
        )
    return Profile(
        name=v["name"], description=v["description"],
        aliases=tuple(_str_list(where, "aliases", v["aliases"])),
        detect_model=v["detect.model"], detect_ram_mb=(ram[0], ram[1]),
        cores=v["compute.cores"], gflops=float(v["compute.gflops"]),
        gpu_gflops=float(v["compute.gpu_gflops"]), ram_mb=v["compute.ram_mb"],
        ram_budget_mb=v["compute.ram_budget_mb"], links=links, default_link=v["default_link"],
        torch_threads=v["training.torch_threads"], batch_size=v["training.batch_size"],
        dtype=v["training.dtype"], compression=v["compression.compression"],
        density=float(v["compression.density"]), group_size=v["compression.group_size"],
        value_dtype=v["compression.value_dtype"], max_frame_bytes=v["runtime.max_frame_bytes"],
        keepalive_s=v["runtime.keepalive_s"], round_deadline_s=float(v["runtime.round_deadline_s"]),
        onnx_providers=tuple(_str_list(where, "runtime.onnx_providers",
                                       v["runtime.onnx_providers"])),
        source=where,
    )  # fmt: skip


def load_profile(path: Path) -> Profile:
    """Load and validate one profile file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, not text
        raise ProfileError(f"profile file {str(path)!r} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile file {str(path)!r} is not valid TOML: {exc}") from None
    return parse_profile(data, str(path))


def builtin_profiles() -> dict[str, Profile]:
    """Every shipped profile by name, in file-name order."""
    folder = resources.files("fedring.firmware_profiles") / "data"
    out = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            p = parse_profile(tomllib.loads(entry.read_text()), f"data/{entry.name}")
            out[p.name] = p
    return out


def load_builtin(name: str) -> Profile:
    """A shipped profile by name or alias (``rpi4`` is ``rpi4-4gb``)."""
    profiles = builtin_profiles()
    for p in profiles.values():
        if name == p.name or name in p.aliases:
            return p
    raise ProfileError(f"unknown profile {name!r}; known: {', '.join(profiles)}")
