"""agentkv's tests: a package, so shared helpers import as ``tests._support.…``."""
