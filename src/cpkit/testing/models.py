"""The tests' name for the small MCore GPT models of `cpkit.models` (re-exported: one module, two
names, so that benchmarks import the library and tests keep their imports)."""

from cpkit.models import *  # noqa: F401,F403 - the re-export is this module's whole purpose
from cpkit.models import __all__  # noqa: F401 - one list of names, kept in cpkit.models
