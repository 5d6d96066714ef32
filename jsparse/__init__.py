"""jsparse: token-sparse attention for long-context LLM inference in JAX/Pallas.

Public API (see README.md): `load`, `build_method`, `make_method`, `generate`, `generate_ids`, `encode`,
`Session` (a multi-turn conversation with a speculative draft), `fingerprint` (of a model, as artifacts record it),
`method_names`, `window_methods`, `make_mesh` and `on_mesh` (several devices:
`load(..., mesh=make_mesh("data=2,model=4"))`, or an already loaded model placed on a mesh), `shipped_artifact`
(the bundled model's calibration artifacts, shipped in the package).
"""

from jsparse.artifacts import shipped_artifact  # noqa: F401
from jsparse.api import build_method, encode, fingerprint, generate, generate_ids, load, on_mesh  # noqa: F401
from jsparse.methods import make_method, method_names, window_methods  # noqa: F401
from jsparse.session import Session  # noqa: F401
from models.sharding import make_mesh  # noqa: F401

__version__ = "0.1.0"
