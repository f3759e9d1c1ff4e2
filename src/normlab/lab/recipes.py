"""The published training recipes: moved to `normlab.recipes`, their one home, which `normlab.replace_norms` and
the lab's GPT both read. Re-exported here for older imports."""

from normlab.recipes import *  # noqa: F401,F403
from normlab.recipes import __all__  # noqa: F401
