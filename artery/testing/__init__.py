"""Helpers for tests and demos that need no model hub: a tiny random model built locally."""
