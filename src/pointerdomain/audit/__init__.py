"""``pointerdomain audit``: find the raw integer addresses a codebase must replace with
typed pointerdomain tables and addresses, and gate new ones in CI.

Built on libcst (qualified names and scopes) for Python and a comment-aware token pass
for C++/CUDA; see docs/audit.md for the rules, the output formats, the baseline and
suppressions. Importing this package imports neither torch nor the compiled extension.
"""

from pointerdomain.audit.autofix import FixResult, fix_source
from pointerdomain.audit.config import AuditConfig, ConfigError, find_config, load_config
from pointerdomain.audit.engine import AuditRun, audit_file, audit_paths, discover
from pointerdomain.audit.rules import RULES, Finding, Rule

__all__ = [
    "RULES",
    "AuditConfig",
    "AuditRun",
    "ConfigError",
    "Finding",
    "FixResult",
    "Rule",
    "audit_file",
    "audit_paths",
    "discover",
    "find_config",
    "fix_source",
    "load_config",
]
