"""The package's version (semver; read by the build from here)."""

__version__ = "1.0.0"
