"""Every exception kvstore raises on purpose.

Each carries a message that names the thing at fault and, where there is one,
the fix. The daemon turns them into error replies with a stable ``code``;
nothing here is ever allowed to take the daemon down.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of all kvstore errors. ``code`` is the protocol's error code."""

    code = "internal"


class ConfigError(KVStoreError):
    """A configuration key has a value that is not allowed; the message names both."""

    code = "config"


class LayoutError(KVStoreError, ValueError):
    """A layout is invalid, or a tensor does not match the layout it should have."""

    code = "layout"


class InvalidTokens(KVStoreError, ValueError):
    """Token ids that cannot be keyed: wrong type, wrong rank, out of range."""

    code = "invalid_tokens"


class InvalidNamespace(KVStoreError, ValueError):
    """A namespace field (model id, tenant, revision) is empty or malformed."""

    code = "invalid_namespace"


class CodecError(KVStoreError):
    """A codec cannot encode a block (unknown codec, bad parameter, bad input)."""

    code = "codec"


class FrameError(CodecError):
    """A frame failed to decode. The block it held must be treated as missing."""

    code = "corrupt_frame"


class TruncatedFrame(FrameError):
    """The frame is shorter than its header says."""


class BadMagic(FrameError):
    """The bytes do not start with the kvstore frame magic."""


class UnsupportedVersion(FrameError):
    """The frame was written by a format version this build cannot read."""


class ChecksumMismatch(FrameError):
    """The frame's checksum does not match its bytes: it was damaged."""


class LayoutMismatch(FrameError):
    """The frame holds a block of another layout than the one expected."""


class StoreLocked(KVStoreError):
    """Another process has the nvme store's directory open; two writers would corrupt the index."""

    code = "store_locked"


class StoreFormatError(KVStoreError):
    """The nvme store's directory holds data of another format version (or is not a kvstore store)."""

    code = "store_format"


class Forbidden(KVStoreError):
    """The connection's authenticated tenant may not do this (another tenant's data, an operator-only op)."""

    code = "forbidden"


class DaemonStarting(KVStoreError, TimeoutError):
    """The daemon is still building its store (allocating pools, reading back its index)."""

    code = "starting"


class ClientClosed(KVStoreError):
    """A call on a client after its ``close()``: make a new client to go on."""

    code = "closed"
