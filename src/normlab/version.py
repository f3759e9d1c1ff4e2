"""The version of normlab, written here once: pyproject.toml reads it (``[tool.setuptools.dynamic]``), the package
exports it as ``normlab.__version__``, and files normlab writes record it."""

__version__ = "0.1.0"
