"""``artery.shared``, installed from the top-level ``shared/`` folder: what every service uses.

Settings, subject and stream names, the bus and the durable consumer (``service_runner`` runs a
consuming service's life), errors and their ack/nak/dead-letter translation, PostgreSQL and its
migrations, logs, traces, metrics, the embedded servers, the pause client, adapters, RULER's
judge core. It imports ``artery.schemas`` and nothing of the services or the SDK
(``tests/test_structure.py``). The map of every folder is docs/architecture/layout.md.
"""
