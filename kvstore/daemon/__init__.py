"""The daemon: a ZeroMQ ROUTER loop in front of the store.

::

    client --(wire)--> server.py (event loop, workers) --> handlers.py --> kvstore.store
                          |                                   |
                          endpoint.py (claiming the socket)    tenancy.py (CURVE tenants' view)
                          auth.py, zap.py (CURVE keys)         metrics.py (Prometheus)

Run it with ``kvstore serve`` or ``python -m kvstore.daemon``.
"""
