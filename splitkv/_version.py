"""The package version, in a module of its own so that pyproject.toml, the CLI and the profiles
read one number without importing the package."""

__version__ = "0.1.0"
