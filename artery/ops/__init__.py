"""Operator tools, apart from the SDK: the ``artery`` command (``cli``), the embedded stack that
``artery up`` and ``LocalBackend`` start (``stack``, ``service_process``), ``replay`` and
``export_model``. They may know the services; the SDK does not."""
