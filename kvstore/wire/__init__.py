"""The wire protocol, without I/O: typed messages, frame encoding, field checks, wire errors.

::

    messages.py   one dataclass per request and reply
    protocol.py   encode/decode of multipart messages, the version handshake
    registry.py   the namespaces hellos register, by tenant, and those given up idle
    fields.py     checkers for header fields
    errors.py     protocol errors and the stable error codes of error replies
"""
