"""The tests' name for the small MCore GPT models of `cpkit.attention.gpt` (re-exported: one module, two
names, so that benchmarks import the library and tests keep their imports)."""

from cpkit.attention.gpt import *  # noqa: F401,F403 - the re-export is this module's whole purpose
from cpkit.attention.gpt import __all__  # noqa: F401 - one list of names, kept in cpkit.attention.gpt
