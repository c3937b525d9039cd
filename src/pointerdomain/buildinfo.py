"""What this installation of pointerdomain is: its version, the commit it was built from,
and the GPU runtime and architectures its ops were built for.

The build writes the facts into ``_build_facts.json`` next to the extension module
(CMakeLists.txt); this module reads them without importing torch or the extension, so ``pointerdomain --version``
and a failed extension import can say what was installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildFacts", "build_facts", "build_rows", "facts_path", "check_torch_runtime", "version", "version_text"]


@dataclass(frozen=True)
class BuildFacts:
    """The facts recorded at build time.

    Attributes:
        version: the package version (from the git tag; ``0.0.0+unknown`` without one).
        commit: the git commit (40 hex digits) or ``unknown`` (no git metadata).
        dirty: the tree had uncommitted changes to tracked files.
        gpu: ``cuda``, ``hip`` or ``none`` (CPU kernels only).
        gpu_why: how the back-end was chosen (``POINTERDOMAIN_GPU=auto chose ...: why``).
        runtime_version: the CUDA toolkit or HIP version the ops were built with ('' for none).
        runtime_link: ``static`` or ``shared`` runtime library ('' for none).
        archs: the GPU architectures (CMake's ``80-real``, ``90``: SASS, plus PTX where not
            ``-real``; HIP: ``gfx942``), empty for none.
    """

    version: str
    commit: str = "unknown"
    dirty: bool = False
    gpu: str = "none"
    gpu_why: str = ""
    runtime_version: str = ""
    runtime_link: str = ""
    archs: tuple[str, ...] = ()

    @property
    def runtime_major(self) -> int | None:
        """The major version of the runtime the GPU ops were built for (None: no GPU ops
        or unknown)."""
        return _major(self.runtime_version) if self.gpu != "none" else None

    def gpu_summary(self) -> str:
        """One phrase: ``CUDA 13.0.88 ops for 80-real;90-real;100 (shared runtime)`` or
        ``CPU kernels only``."""
        if self.gpu == "none":
            return "CPU kernels only"
        name = _RUNTIME_TITLE[self.gpu]
        return f"{name} {self.runtime_version} ops for {';'.join(self.archs)} ({self.runtime_link} runtime)"

    def commit_text(self) -> str:
        """The commit's first 12 digits (``+dirty`` when built from a modified tree)."""
        return self.commit[:12] + ("+dirty" if self.dirty else "")


#: how each GPU back-end of the build names its runtime (the ``gpu`` fact: cuda or hip)
_RUNTIME_TITLE: dict[str, str] = {"cuda": "CUDA", "hip": "HIP"}


def _major(text: str | None) -> int | None:
    head = (text or "").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _installed_version() -> str:
    try:
        return importlib.metadata.version("pointerdomain")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def facts_path() -> Path | None:
    """Where the build facts of the extension found on ``sys.path`` lie (not imported), or
    None without an extension."""
    spec = importlib.util.find_spec("pointerdomain._C")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).with_name("_build_facts.json")


@functools.cache
def build_facts() -> BuildFacts:
    """The facts of this installation (read once). A tree used without a build (no
    ``_build_facts.json``) gives the installed distribution's version and nothing else."""
    path = facts_path()
    try:
        raw = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        raw = None
    if not isinstance(raw, dict):
        return BuildFacts(version=_installed_version(), gpu_why="no build facts (pointerdomain was not built here)")
    archs = str(raw.get("archs", ""))
    return BuildFacts(
        version=str(raw.get("version", "")) or _installed_version(),
        commit=str(raw.get("commit", "unknown")),
        dirty=bool(raw.get("dirty", False)),
        gpu=str(raw.get("gpu", "none")),
        gpu_why=str(raw.get("gpu_why", "")),
        runtime_version=str(raw.get("runtime_version", "")),
        runtime_link=str(raw.get("runtime_link", "")),
        archs=tuple(a for a in archs.split(";") if a),
    )


def version() -> str:
    """The package version (``pointerdomain.__version__``)."""
    return build_facts().version


def version_text() -> str:
    """What ``pointerdomain --version`` prints: version, commit, GPU ops and how they were
    chosen, and whether the extension is present (found, not imported)."""
    facts = build_facts()
    present = importlib.util.find_spec("pointerdomain._C") is not None
    lines = [f"pointerdomain {facts.version} (commit {facts.commit_text()})",
             f"ops: {facts.gpu_summary()}" + ("" if present else " -- extension missing")]
    if facts.gpu_why:
        lines.append(f"build: {facts.gpu_why}")
    return "\n".join(lines)


def build_rows() -> list[tuple[str, str, str]]:
    """``pointerdomain doctor``'s rows for the build: (name, value, how it was found)."""
    facts = build_facts()
    return [("built from commit", facts.commit_text(), "git at build time"),
            ("ops built for", facts.gpu_summary(), facts.gpu_why)]


def check_torch_runtime(facts: BuildFacts, torch_cuda: str | None, torch_hip: str | None) -> None:
    """Check that the GPU ops of ``facts`` can share a process with a torch built for
    ``torch_cuda`` / ``torch_hip`` (``torch.version.cuda`` / ``torch.version.hip``; both None:
    a CPU build of torch, which any build accepts).

    Raises:
        GpuRuntimeMismatchError: the ops were built for one GPU runtime (CUDA or HIP) or
            major version and torch for another: the extension would need a second runtime
            of another major (not found, or two in one process), so it is not imported.
    """
    if facts.gpu == "none" or (torch_cuda is None and torch_hip is None):
        return
    from pointerdomain.errors import GpuRuntimeMismatchError  # pydantic: not for `import pointerdomain`
    built = _RUNTIME_TITLE[facts.gpu]
    torch_name, torch_version = ("HIP", torch_hip) if torch_hip is not None else ("CUDA", torch_cuda)
    major = facts.runtime_major
    if torch_name == built and (major is None or _major(torch_version) == major):
        return
    raise GpuRuntimeMismatchError(
        f"pointerdomain {facts.version} has {facts.gpu_summary()}, but torch was built for {torch_name} "
        f"{torch_version}: install the pointerdomain wheel for {torch_name} {_major(torch_version)} (README, "
        "Install), or build from source with that toolkit (`POINTERDOMAIN_GPU=cuda pip install .`)",
        built=f"{built} {facts.runtime_version}", torch=f"{torch_name} {torch_version}")
