"""``artery.services``, installed from the top-level ``services/`` folder: one package per service.

collector, reward, trainer, publisher, inference and console each run as their own process
(``python -m artery.services.<name>``): a short ``main.py``, a ``settings`` struct read from the
environment, handlers, and pure logic. A service knows the others only through NATS subjects; it
imports ``artery.shared`` and ``artery.schemas``, never another service and never the SDK
(``tests/test_structure.py``). The map of every folder is docs/architecture/layout.md.
"""
