"""The fix engine.

A fix names one or more targets (a module and a symbol in megatron-core or Megatron-Bridge).
When a target's module is imported (or right away, if it already is), the engine reads the
target's source and decides, once, what to do with it, then installs the replacement (or
leaves the code alone, and warns once where a spot stays unfixed). By job:

- ``records``: states, the ``Check``/``Target``/``Fix`` dataclasses, the warning and the log;
- ``source``: syntax trees, normalised source, fingerprints, the site checks fixes use;
- ``decide``: the decision from source alone (also run by ``tools/coverage.py`` over trees
  it does not import);
- ``rewrite``: the drift form that recompiles a live function with its bug expressions replaced;
- ``hooks``: when the decision runs (wrapt's post-import hooks; the finder for module targets;
  the trigger of the deferred start);
- ``install``: ``apply``/``activate``/``status``, the live decision and the installation.

Import cost: ``import mcore_cpu_shim`` runs first in every conversion process, most of which
never meet a fix, so the fix modules are loaded by the first import of ``megatron``, and what
the decision needs (ast, inspect, hashlib, wrapt, ...) each function imports when it first
runs. ``benchmarks/bench_import.py`` prints the cost as a ratio to ``import torch``.
"""

from .decide import absent, classify, classify_source, live_lookup, strict_from_env
from .install import activate, apply, parse_disabled, status
from .records import (
    APPLIED,
    DISABLED,
    DRIFTED,
    ENV_DISABLE,
    ENV_DRIFT_ONLY,
    ENV_STRICT,
    INHERITED,
    MARKER,
    MODULE,
    NOT_APPLICABLE,
    PACKAGE,
    PENDING,
    REPORT_URL,
    UNSUPPORTED,
    UPSTREAM_FIXED,
    Check,
    Fix,
    McoreCpuShimWarning,
    Target,
    combined_state,
    log,
)
from .rewrite import HELPERS, rewrite, rewriting
from .source import (
    Code,
    cuda_attributes,
    declares,
    find_definition,
    fingerprint,
    function_tree,
    normalise,
    normalised_source,
    occurs,
    other_takes,
    takes,
    top_level_imports,
    uses_only,
)
from .tree import bridge_version, mcore_version, module_file  # noqa: E402,F401  (the app, tests)
