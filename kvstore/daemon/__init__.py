"""The daemon: a ZeroMQ ROUTER loop in front of the store.

::

    client --(wire)--> server.py (event loop, workers) --> handlers.py --> kvstore.store
                          |                                   |
                          endpoint.py (claiming the socket)    tenancy.py (CURVE tenants' view)
                          auth.py, zap.py (CURVE keys)         shared_ops.py (same-host reads, writes)
                                                               pin_quota.py (pins by tenant)
                                                               metrics.py (Prometheus)

Run it with ``kvstore serve`` or ``python -m kvstore.daemon``.
"""
