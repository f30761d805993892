"""``art.local.backend.LocalBackend``, ART's module path for the same class."""

from artery.backend import LocalBackend

__all__ = ["LocalBackend"]
