"""jsparse: token-sparse attention for long-context LLM inference in JAX/Pallas.

Public API (see README.md): `load`, `build_method`, `generate`, `encode`, `method_names`,
`window_methods`.
"""

from jsparse.api import build_method, encode, fingerprint, generate, load  # noqa: F401
from jsparse.methods import make_method, method_names, window_methods  # noqa: F401
from jsparse.session import Session  # noqa: F401

__version__ = "0.1.0"
