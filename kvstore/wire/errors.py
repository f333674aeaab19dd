"""Errors of the wire protocol, and the stable error codes of error replies.

Three different things go wrong on a wire, and each has its own exception:

- LocalProtocolError: this side was asked to send something the protocol does
  not allow (nothing was sent).
- RemoteProtocolError: the peer sent something the protocol does not allow.
  The daemon answers it with an error reply carrying ``code``; a client drops
  the connection it came on.
- ServerError: the daemon answered a well-formed request with an error reply.
  Codes of kvstore.errors classes come back to the client as those classes
  (a remote ``layout`` error raises LayoutError), with ServerError mixed in.
"""

from __future__ import annotations

from kvstore import errors
from kvstore.errors import KVStoreError

# code -> what it means; a code never changes meaning once published.
ERROR_CODES: dict[str, str] = {
    "bad_message": "frame 0 is not a msgpack map",
    "bad_header": "a header field is missing, unknown or of the wrong type",
    "unknown_op": "the op is not one this daemon serves",
    "version": "the protocol version is not one this daemon speaks",
    "bad_frames": "the number of payload frames does not match the op",
    "bad_payload": "the payload's size does not match its shape and dtype",
    "too_large": "the message or its header is over the daemon's limit",
    "too_many_tokens": "more token ids than max_tokens_per_request",
    "no_staging": "no shared-memory staging room for this client now; nothing was done (use the socket)",
    "too_many_leases": "this client holds all the shared-memory leases it may (it located or reserved "
    "without finishing): nothing was done; use the socket for this request",
    "no_shared_memory": "a shared-memory op to a daemon that offers none now (it restarted with shared "
    "memory off): nothing was done; hello again and use the socket",
    "busy": "requests in flight are at a limit (this client's, its tenant's or the daemon's); retry",
    "unknown_namespace": "the ns id was never registered with hello (or the daemon restarted)",
    "not_found": "the session (or other named thing) does not exist",
    "invalid_argument": "a field has a value outside what the op allows",
    "shutting_down": "the daemon is stopping and takes no new requests",
    "starting": "the daemon is still building its store; nothing was done (the client waits and retries)",
    "quota_exceeded": "the tenant is at one of its per-tenant quotas ([server] max_*_per_tenant)",
    "timeout": "no reply within the client's timeout (client side only)",
    "internal": "an unexpected error inside the daemon; the daemon logged it",
    "config": "a configuration value is not allowed",
    "layout": "a layout is invalid or a tensor does not match the namespace's layout",
    "invalid_tokens": "token ids that cannot be keyed (type, rank, range)",
    "invalid_namespace": "a namespace field is empty or malformed",
    "codec": "a codec could not encode a block",
    "corrupt_frame": "a stored frame failed its checks and was dropped",
    "tier_full": "no room in a tier: every block there is pinned",
    "tier_io": "the backing store failed (disk full, I/O error)",
    "store_locked": "another daemon holds the LMDB path",
    "invalid_filter": "an evict filter with no criterion, or an unknown tier",
    "forbidden": "the connection's authenticated tenant may not do this (another tenant, an operator op)",
}

# codes of the store's own errors that reach a reply under a published code
_ALIASES = {"invalid_request": "invalid_argument", "closed": "shutting_down"}


def wire_code(code: str | None) -> str:
    """The published code (ERROR_CODES) a reply carries for an error of ``code``: its alias, or
    "internal" for one that is not published (the message still says what happened)."""
    code = _ALIASES.get(code or "", code)
    return code if code in ERROR_CODES else "internal"


class ProtocolError(KVStoreError):
    """Base of protocol errors; ``code`` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LocalProtocolError(ProtocolError):
    """This side tried to send a message the protocol forbids; nothing was sent."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a message the protocol forbids. ``request_id`` is its id when it could be read;
    ``op``: the request's op when it is one the protocol knows (None: unknown, or unread)."""

    def __init__(self, code: str, message: str, request_id: int | None = None, op: str | None = None) -> None:
        super().__init__(code, message)
        self.request_id = request_id
        self.op = op


class ServerError(KVStoreError):
    """The daemon answered with an error reply (``code``, ``message``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message


class RequestTimeout(ServerError, TimeoutError):
    """No reply came within the timeout (after the retries an idempotent request gets)."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


class DeadlinePassed(RequestTimeout):
    """The caller's deadline (``KVStoreClient.within``) passed before the reply came: the daemon
    answers, maybe, but not within what the caller could wait."""


def _library_classes() -> dict[str, type[KVStoreError]]:
    found: dict[str, type[KVStoreError]] = {}
    for obj in vars(errors).values():
        if isinstance(obj, type) and issubclass(obj, KVStoreError) and obj is not KVStoreError:
            found.setdefault(obj.code, obj)  # first definition of a code is its base class
    return found


def error_for_reply(code: str, message: str) -> ServerError:
    """The exception a client raises for an error reply: the library's class for its code, else ServerError."""
    base = _library_classes().get(code)
    if base is None:
        return ServerError(code, message)
    cls = type(f"Server{base.__name__}", (ServerError, base), {})
    return cls(code, message)
