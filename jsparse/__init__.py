"""jsparse: token-sparse attention for long-context LLM inference in JAX/Pallas.

Public API (see README.md): `load`, `build_method`, `generate`, `encode`, `method_names`,
`window_methods`, `make_mesh` (several devices: `load(..., mesh=make_mesh("data=2,model=4"))`).
"""

from jsparse.api import build_method, encode, fingerprint, generate, load, on_mesh  # noqa: F401
from jsparse.methods import make_method, method_names, window_methods  # noqa: F401
from jsparse.session import Session  # noqa: F401
from models.sharding import make_mesh  # noqa: F401

__version__ = "0.1.0"
