"""``[tool.pointerdomain.audit]`` in pyproject.toml: the audit's configuration.

Keys (all optional)::

    [tool.pointerdomain.audit]
    paths = ["python", "csrc"]          # what `pointerdomain audit` checks when given no PATH
    exclude = ["third_party/**"]        # globs (fnmatch, against the path relative to the config file); added
                                        # to the defaults (.git, .venv, venv, build, node_modules, __pycache__)
    select = ["PD0"]                    # code prefixes to run (default: every rule)
    ignore = ["PD103"]                  # code prefixes to skip
    per_file_ignores = { "tests/**" = ["PD002"] }
    kernel_ops = ["sgl_kernel.transfer_kv_all_layer"]   # PD007: qualified names of ops that need a PointerTable
    baseline = "audit-baseline.json"    # findings recorded here do not fail (relative to the config file)
    jobs = 0                            # worker processes; 0 = os.cpu_count()
    cpp = true                          # run the PD1xx pass on .cpp/.cc/.cu/.cuh/.h/.hpp files
    max_file_kb = 1024                  # larger files (generated kernels, tables) are skipped and reported
    file_timeout = 60.0                 # seconds per file; a file past it is reported as skipped
    allow_skipped = false               # true: files not audited (size cap, timeout, parse error) do not
                                        # fail the run (exit status 3 otherwise)

Unknown keys and wrong types are errors (exit status 2), not silently ignored.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path
from typing import Any

import pydantic

from pointerdomain.audit.rules import OPT_IN, RULES
from pointerdomain.validated import ValidatedModel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["DEFAULT_EXCLUDES", "AuditConfig", "ConfigError", "find_config", "load_config"]

DEFAULT_EXCLUDES = (".git", ".hg", ".venv", "venv", ".tox", ".nox", "build", "node_modules", "__pycache__",
                    ".mypy_cache", ".pytest_cache", "*.egg-info")


class ConfigError(ValueError):
    """The configuration (or a command-line option naming rules or files) is invalid."""


class AuditConfig(ValidatedModel, frozen=True):
    """The validated ``[tool.pointerdomain.audit]`` table. ``root`` is the directory of
    the file it came from (the current directory when there is none); relative paths in
    it are relative to ``root``."""

    model_config = pydantic.ConfigDict(frozen=True, strict=True, extra="forbid")

    paths: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    per_file_ignores: dict[str, tuple[str, ...]] = pydantic.Field(default_factory=dict)
    kernel_ops: tuple[str, ...] = ()
    baseline: str | None = None
    jobs: int = pydantic.Field(default=0, ge=0)
    cpp: bool = True
    max_file_kb: int = pydantic.Field(default=1024, gt=0)
    file_timeout: float = pydantic.Field(default=60.0, gt=0, le=1e9, allow_inf_nan=False)  # a timer the kernel takes
    allow_skipped: bool = False
    root: Path = pydantic.Field(default_factory=Path.cwd, exclude=True)
    source: Path | None = pydantic.Field(default=None, exclude=True)

    @pydantic.field_validator("select", "ignore")
    @classmethod
    def _known_prefixes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in v:
            if not any(code.startswith(prefix) for code in RULES):
                raise ValueError(f"{prefix!r} matches no rule code (codes: {', '.join(RULES)})")
        return v

    @pydantic.field_validator("per_file_ignores")
    @classmethod
    def _known_codes(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for glob, prefixes in v.items():
            cls._known_prefixes(prefixes)
        return v

    def enabled(self) -> frozenset[str]:
        """The codes that run: ``select`` (default all) minus ``ignore``. An opt-in rule
        (:data:`~pointerdomain.audit.rules.OPT_IN`) runs only when ``select`` names its
        full code. PD900 (a suppression with no reason) cannot be ignored."""
        selected = {c for c in RULES if (c not in OPT_IN and (not self.select or any(c.startswith(p)
                                                                                     for p in self.select)))
                    or c in self.select}
        selected -= {c for c in RULES if any(c.startswith(p) for p in self.ignore)}
        return frozenset(selected | {"PD900"})

    def relative(self, path: Path) -> str:
        try:
            return path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:  # outside the root
            return path.as_posix()
        except (RuntimeError, OSError):  # a symlink loop resolves nowhere: the link's own place
            rel = Path(os.path.relpath(path.absolute(), self.root.resolve()))
            return path.as_posix() if rel.parts[:1] == ("..",) else rel.as_posix()

    def is_excluded(self, path: Path) -> bool:
        """True if ``path`` (or a directory above it) matches a default or configured exclude."""
        rel = self.relative(path)
        if any(fnmatch.fnmatch(part, pat) for part in Path(rel).parts for pat in DEFAULT_EXCLUDES):
            return True
        return any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel + "/", pat) for pat in self.exclude)

    def ignored_for(self, path: Path) -> tuple[str, ...]:
        rel = self.relative(path)
        out: list[str] = []
        for glob, prefixes in self.per_file_ignores.items():
            if fnmatch.fnmatch(rel, glob):
                out.extend(prefixes)
        return tuple(out)


def find_config(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above ``start`` that has a
    ``[tool.pointerdomain.audit]`` table, or None."""
    start = start.resolve()
    for d in [start, *start.parents] if start.is_dir() else list(start.parents):
        candidate = d / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                continue
            if isinstance(data.get("tool", {}).get("pointerdomain", {}).get("audit"), dict):
                return candidate
    return None


def load_config(path: Path | None) -> AuditConfig:
    """Read ``[tool.pointerdomain.audit]`` from ``path`` (a pyproject.toml or any TOML
    file with that table); defaults when ``path`` is None.

    Raises:
        ConfigError: unreadable TOML, a missing table in an explicitly given file, an
            unknown key, or a value of the wrong type.
    """
    if path is None:
        return AuditConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML (not UTF-8): {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    table: Any = data.get("tool", {}).get("pointerdomain", {}).get("audit")
    if table is None:
        table = {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.pointerdomain.audit] must be a table")
    try:
        # TOML arrays arrive as lists; the model holds tuples (strict mode converts nothing else).
        raw: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
        pfi = raw.get("per_file_ignores")
        if isinstance(pfi, dict):
            raw["per_file_ignores"] = {k: tuple(v) if isinstance(v, list) else v for k, v in pfi.items()}
        if "root" in raw or "source" in raw:
            raise ConfigError(f"{path}: [tool.pointerdomain.audit]: unknown key(s) root/source")
        return AuditConfig.model_validate(raw | {"root": path.parent.resolve(), "source": path})
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: [tool.pointerdomain.audit]: {problems}") from None
