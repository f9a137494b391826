"""What ``perfmon-agent doctor`` finds, as data: one :class:`Check` per capability, the
rule from checks to an exit status, and the small parsers of what the checks read
(``/proc/self/mounts``, the kernel's lockdown file, library and interpreter file names,
``py-spy --version``, torch's ``version.py``). No I/O: callers hand the text in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1  # parsers/data/doctor.schema.json

# A check's result. ``absent``: the thing is not on this host and nothing is lost
# for it (no NVIDIA GPU, so no NVML; no BTF, which the agent's programs do not use).
OK, DEGRADED, FAILED, ABSENT = "ok", "degraded", "failed", "absent"
STATUSES = (OK, DEGRADED, FAILED, ABSENT)
HOST, JOB = "host", "job"  # a check's scope

# The CPython versions py-spy reads. py-spy 0.4.0 documents 3.3 to 3.13
# (benfred/py-spy#714, #720; 2.3-2.7 too, where no PyTorch runs); later 0.4.x
# releases add 3.14 (#833). A newer target is reported as possibly unsupported
# (degraded), and the dump of the job itself, when it works, settles it.
PYSPY_PYTHON_RANGE = ((3, 3), (3, 13))

_PYTHON_FILE = re.compile(r"^(?:lib)?python(\d+)\.(\d+)")
_PYSPY_VERSION = re.compile(r"\bpy-spy\s+(\d+(?:\.\d+)*\S*)")
_TORCH_VERSION = re.compile(r"""^__version__\s*=\s*['"]([^'"\n]{1,64})['"]""", re.MULTILINE)
_SONAME_TAIL = re.compile(r"^\.(\d+(?:\.\d+)*)$")
_LOCKDOWN = re.compile(r"\[(\w+)\]")
_MOUNT_ESCAPE = re.compile(r"\\([0-7]{3})")
_TORCH_LIBRARY_TAIL = "/torch/lib/libtorch_cpu.so"


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table.

    ``fix``: what an operator can do about it; ``fallback``: what the agent does
    instead (both None when the check works). ``facts``: what was found, for --json
    (paths, versions, each symbol found or not).
    """

    name: str
    status: str
    detail: str
    fix: str | None = None
    fallback: str | None = None
    scope: str = HOST
    facts: Mapping[str, Any] = field(default_factory=dict)

    @property
    def works(self) -> bool:
        """True when nothing is lost for it: ok, or not present and not needed."""
        return self.status in (OK, ABSENT)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scope": self.scope, "status": self.status,
                "detail": self.detail, "fix": self.fix, "fallback": self.fallback,
                "facts": dict(self.facts)}


def overall_status(checks: Iterable[Check]) -> str:
    """``ok`` when every check works, else ``degraded`` (something falls back)."""
    return OK if all(c.works for c in checks) else DEGRADED


def exit_code(checks: Iterable[Check]) -> int:
    """0 when every check works, 1 when anything the host or the job needs degrades."""
    return 0 if overall_status(checks) == OK else 1


def capability_values(checks: Iterable[Check]) -> dict[str, bool]:
    """check name -> whether it works (the ``perfmon_capability`` gauge: 1 or 0)."""
    return {c.name: c.works for c in checks}


def doctor_document(checks: Sequence[Check], host: Mapping[str, Any],
                    job: Mapping[str, Any] | None) -> dict[str, Any]:
    """The --json document (parsers/data/doctor.schema.json)."""
    return {"schema_version": SCHEMA_VERSION, "status": overall_status(checks),
            "exit_code": exit_code(checks), "host": dict(host),
            "job": dict(job) if job is not None else None,
            "checks": [c.to_dict() for c in checks]}


def error_document(code: int, message: str) -> dict[str, Any]:
    """The --json document when no report can be made (no such process, ...)."""
    return {"schema_version": SCHEMA_VERSION, "status": "error", "exit_code": code,
            "error": message}


def tracefs_mount_points(mounts: str) -> list[str]:
    """Where tracefs is mounted, from /proc/self/mounts (octal escapes undone)."""
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "tracefs":
            found.append(_MOUNT_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[1]))
    return found


def has_filesystem(filesystems: str, name: str) -> bool:
    """Whether /proc/filesystems lists ``name`` (the kernel can mount it)."""
    return any(line.split()[-1:] == [name] for line in filesystems.splitlines())


def lockdown_mode(text: str) -> str | None:
    """The active mode of /sys/kernel/security/lockdown ("[none] integrity
    confidentiality" -> "none"); None when the text names none."""
    found = _LOCKDOWN.search(text)
    return found.group(1) if found else None


def kernel_version(release: str) -> tuple[int, int] | None:
    """(major, minor) of a kernel release string ("6.18.44-fc" -> (6, 18))."""
    found = re.match(r"^(\d+)\.(\d+)", release)
    return (int(found.group(1)), int(found.group(2))) if found else None


def python_version(paths: Iterable[str]) -> tuple[int, int] | None:
    """The CPython version a process runs, from the names of its executable and mapped
    files (``python3.11``, ``libpython3.11.so.1.0``); None when no name tells."""
    for path in paths:
        found = _PYTHON_FILE.match(path.rsplit("/", 1)[-1])
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def pyspy_supports(version: tuple[int, int]) -> bool:
    """Whether ``version`` lies in PYSPY_PYTHON_RANGE."""
    low, high = PYSPY_PYTHON_RANGE
    return low <= version <= high


def pyspy_version(output: str) -> str | None:
    """The version in ``py-spy --version``'s output ("py-spy 0.4.3" -> "0.4.3")."""
    found = _PYSPY_VERSION.search(output)
    return found.group(1) if found else None


def soname_version(basename: str, prefix: str) -> str | None:
    """The version a library's file name carries after ``prefix`` ("libcudart.so.12.4.127",
    "libcudart.so" -> "12.4.127"); None for the bare name."""
    if not basename.startswith(prefix):
        return None
    found = _SONAME_TAIL.match(basename[len(prefix):])
    return found.group(1) if found else None


def torch_version_file(library_path: str) -> str | None:
    """Where torch's ``version.py`` lies beside a pip-installed libtorch_cpu.so
    (``.../torch/lib/libtorch_cpu.so`` -> ``.../torch/version.py``), else None."""
    if not library_path.endswith(_TORCH_LIBRARY_TAIL):
        return None
    return library_path[: -len(_TORCH_LIBRARY_TAIL)] + "/torch/version.py"


def torch_version(source: str) -> str | None:
    """``__version__`` of torch's version.py ("2.13.0+cpu"); None when it has none."""
    found = _TORCH_VERSION.search(source)
    return found.group(1) if found else None
