"""Former name of :mod:`jaxfednas.privacy.dp_fnas` (one spelling with
``jaxfednas.algorithms.dp_fnas``); importing it warns, and it goes in the next release."""
import warnings

from jaxfednas.privacy.dp_fnas import *  # noqa: F403
from jaxfednas.privacy.dp_fnas import __all__  # noqa: F401

warnings.warn("jaxfednas.privacy.dpfnas is now jaxfednas.privacy.dp_fnas", DeprecationWarning, stacklevel=2)
