"""segxfer errors as Python exceptions.

One class per code of the C table (SX_ERRNO_MAP in include/segxfer/errors.h),
named like the code (SX_ENOENT, SX_ETIMEDOUT, ...) and generated at import
from the library itself with sx_err_name(), so codes added to the table
appear here without a change.  All derive from SegxferError, which carries
the code, its name, its fixed text and the message the failing call left.
SX_EINVAL is also a ValueError and SX_ETIMEDOUT a TimeoutError, so generic
handlers catch them.  IncompatibleLayout (an SX_EINCOMPAT) carries the
structured mismatch of a layout check.
"""
from . import _lib


class SegxferError(Exception):
    """A segxfer call failed.  code is the negative SX_E* value, name its
    name ("SX_ENOENT"), strerror its fixed text, message what failed."""

    code = 0
    name = "SX_UNKNOWN"

    def __init__(self, message=None, code=None):
        if code is not None:
            self.code = code
            self.name = _lib.text(_lib.lib.sx_err_name(code))
        text = _lib.text(_lib.lib.sx_strerror(self.code))
        # Base classes first: OSError (under TimeoutError) sets strerror.
        super().__init__(message or text)
        self.strerror = text
        self.message = message or text

    def __str__(self):
        return "%s (%s)" % (self.message, self.name)


_BASES = {"SX_EINVAL": (ValueError,), "SX_ETIMEDOUT": (TimeoutError,)}
_BY_CODE = {}
_BY_NAME = {}


def _generate():
    """A class per code of the library's table: the codes run from -1 down,
    without gaps, until sx_err_name() answers SX_UNKNOWN."""
    code = -1
    while True:
        name = _lib.text(_lib.lib.sx_err_name(code))
        if name == "SX_UNKNOWN" or code < -4096:
            break
        cls = type(name, (SegxferError,) + _BASES.get(name, ()),
                   {"code": code, "name": name, "__module__": __name__,
                    "__doc__": _lib.text(_lib.lib.sx_strerror(code))})
        globals()[name] = cls
        _BY_CODE[code] = cls
        _BY_NAME[name] = cls
        code -= 1


_generate()


# An SX_EINCOMPAT: `except SX_EINCOMPAT` catches both.
class IncompatibleLayout(_BY_NAME["SX_EINCOMPAT"]):
    """A layout check failed before anything was read.  kind is the mismatch
    kind ("dtype", "block_bytes", "missing_key", ...), field the descriptor
    field, group/layer/slot where it differs (for key and block_bytes
    mismatches), local and remote the two values as text."""

    def __init__(self, message, kind, field, group, layer, slot, local, remote):
        super().__init__(message)
        self.kind, self.field = kind, field
        self.group, self.layer, self.slot = group, layer, slot
        self.local, self.remote = local, remote


CODES = dict(_BY_CODE)  # code -> class


def error(code, message=None):
    """The exception for a negative code (SegxferError for an unknown one)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return SegxferError(message, code)
    return cls(message)


def check(rc, what=None):
    """Raise the exception for rc if it is an error; return rc otherwise.
    The message is what the failing call left (sx_errmsg())."""
    if rc >= 0:
        return rc
    msg = _lib.text(_lib.lib.sx_errmsg())
    if what:
        msg = "%s: %s" % (what, msg) if msg else what
    raise error(rc, msg or None)


def code(name):
    """The value of a code by name: code("SX_ETIMEDOUT") == -10."""
    return _BY_NAME[name].code


def invalid(message):
    """An SX_EINVAL for bad input caught on the Python side."""
    return _BY_NAME["SX_EINVAL"](message)
