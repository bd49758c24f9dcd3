"""The toolkit's version, in a leaf module: records and the environment description read it without
importing the package's public API (and with it every subpackage)."""

__version__ = "0.1.0"
