"""Inference engines behind one small interface (``base.Engine``)."""
