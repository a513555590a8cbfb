"""The package version, in one place: setup.py reads this file without importing the package."""

__version__ = "0.1.0"
