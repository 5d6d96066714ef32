"""Attention methods and baselines, registered by name (see `jsparse.methods.base`)."""

from jsparse.methods.base import calibrators, make_method, method_names, register, window_methods  # noqa: F401
from jsparse.methods import dense, kascade, kascade_calibration, oracle, quest, streaming  # noqa: F401  (registration)
from jsparse.methods import tsa, tsa_calibration, tsa_kascade  # noqa: F401  (registration)
from jsparse.methods import butler, h2o  # noqa: F401  (registration)
from jsparse.methods import evosparse, evosparse_calibration  # noqa: F401  (registration: evosparse, ablations)
from jsparse.methods import sts, sts_calibration  # noqa: F401  (registration: sts, calibrate sts)
