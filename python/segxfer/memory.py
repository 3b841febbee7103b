"""Memory and id arrays from Python objects, without a loop per element.

memory_of() finds the address, length and location ("cpu", "cuda:N") of a
torch tensor, an object with __cuda_array_interface__ or __array_interface__
(numpy, CuPy, Numba ...), or a writable buffer (bytearray, mmap,
array.array).  None of these imports torch or numpy: they read the objects'
own protocols.  Where an object names no device (a raw address, the CUDA
array interface), the library says where the memory is (sx_mem_location).

ids_of() turns block ids (a list, range, array.array, numpy array or torch
tensor of integers) into one contiguous uint64 buffer for
sx_batch_add_block_ids, converting in C (array.array, numpy, torch) and
checking for negatives with one min() over the array.
"""
import array
import collections.abc
import ctypes

from . import _lib
from .errors import check, invalid

_INT_CODES = "bBhHiIlLqQ"


def _tensor_location(dev):
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        index = dev.index
        if index is None:  # "cuda" without an index: the current device
            import torch
            index = torch.cuda.current_device()
        return "cuda:%d" % index
    raise invalid("tensors on device %r cannot be registered (cpu or cuda only)" % str(dev))


def _is_tensor(obj):
    return all(hasattr(obj, a) for a in ("data_ptr", "is_contiguous", "element_size",
                                         "numel", "device"))


def _interface_contiguous(shape, strides, itemsize):
    if strides is None:
        return True
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


def _from_interface(ai, what, location):
    data = ai.get("data")
    ptr = data[0] if isinstance(data, tuple) else data
    if not isinstance(ptr, int):
        raise invalid("%s: the array interface has no data pointer" % what)
    # (ptr, read-only flag): as for buffers, memory segxfer may write into
    # must be writable (np.frombuffer(bytes) would have the bytes object,
    # which Python shares and never expects to change, overwritten).
    if isinstance(data, tuple) and len(data) > 1 and data[1]:
        raise invalid("%s: the array is read-only: segxfer writes into registered "
                      "memory and read destinations (copy it first)" % what)
    shape = tuple(ai.get("shape", ()))
    itemsize = int(ai["typestr"][2:])
    if not _interface_contiguous(shape, ai.get("strides"), itemsize):
        raise invalid("%s: the array is not C-contiguous (registered memory must be "
                      "one contiguous range; copy it with .copy() first)" % what)
    n = itemsize
    for d in shape:
        n *= d
    return ptr, n, location


def memory_of(obj, location=None):
    """(addr, nbytes, location, keepalive) for obj.  keepalive must be held
    as long as the library may use the memory."""
    if _is_tensor(obj):
        if not obj.is_contiguous():
            raise invalid("the tensor is not contiguous (strides %s): registered memory "
                          "must be one contiguous range; use .contiguous() on the cache "
                          "allocation" % (tuple(obj.stride()),))
        return (obj.data_ptr(), obj.numel() * obj.element_size(),
                location or _tensor_location(obj.device), obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, n, loc = _from_interface(cai, "__cuda_array_interface__", location)
        # The interface names no device: the driver knows it.
        return ptr, n, loc or pointer_location(ptr, n), obj
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        ptr, n, loc = _from_interface(ai, "__array_interface__", location or "cpu")
        return ptr, n, loc, obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError("cannot register %s: pass a torch tensor, an object with "
                        "__cuda_array_interface__/__array_interface__, a writable buffer, "
                        "or addr= and length=" % type(obj).__name__) from None
    if not mv.c_contiguous:
        raise invalid("the buffer is not C-contiguous")
    if mv.readonly:
        raise invalid("the buffer is read-only: segxfer writes into registered memory "
                      "(use a bytearray, or pass addr= and length=)")
    if mv.nbytes == 0:
        raise invalid("the buffer is empty")
    # A ctypes view pins the buffer: a bytearray cannot be resized under it.
    view = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(view), mv.nbytes, location or "cpu", (obj, mv, view)


def pointer_location(addr, length=0):
    """"cpu" or "cuda:N" for memory given as a raw address (LMDeploy
    registers data_ptr() values, which carry no device): the library asks
    the CUDA driver (sx_mem_location) and checks [addr, addr+length) as
    register will; raises its error (SX_EBOUNDS, SX_EINVAL) otherwise."""
    out = ctypes.create_string_buffer(_lib.TAG_MAX + 1)
    check(_lib.lib.sx_mem_location(addr, length, out, len(out)), "location of 0x%x" % addr)
    return out.value.decode()


# ------------------------------------------------------------------ ids


def _check_min(lo, where):
    if lo < 0:
        raise invalid("%s: block ids must not be negative (found %d)" % (where, lo))


def _ids_tensor(t, where):
    if t.is_floating_point() or t.is_complex() or str(t.dtype) == "torch.bool":
        raise invalid("%s: block ids must be an integer tensor, not %s" % (where, t.dtype))
    if t.dim() != 1:
        raise invalid("%s: block ids must be one-dimensional (shape %s)"
                      % (where, tuple(t.shape)))
    if t.device.type == "meta":
        # A meta tensor has a shape but no values (.cpu() raises
        # NotImplementedError).
        raise invalid("%s: block ids are a tensor on the meta device, which holds no "
                      "values" % where)
    if t.device.type != "cpu":
        t = t.cpu()
    import torch
    t = t.to(torch.int64).contiguous()
    if t.numel():
        _check_min(int(t.min()), where)
    return t.data_ptr(), t.numel(), t


def _ids_numpy(a, where):
    import numpy as np
    if a.dtype.kind not in "iu":
        raise invalid("%s: block ids must be an integer array, not %s" % (where, a.dtype))
    if a.ndim != 1:
        raise invalid("%s: block ids must be one-dimensional (shape %s)" % (where, a.shape))
    if a.dtype.kind == "i" and a.size:
        _check_min(int(a.min()), where)
    a = np.ascontiguousarray(a, dtype=np.uint64)
    return a.ctypes.data, a.size, a


def _ids_array(a, where):
    if a.typecode not in _INT_CODES:
        raise invalid("%s: block ids must be integers, not array('%s')" % (where, a.typecode))
    if a.typecode in "bhilq" and len(a):
        _check_min(min(a), where)
    if a.itemsize != 8:
        a = array.array("Q", a)
    addr, n = a.buffer_info()
    return addr, n, a


def ids_of(obj, where="ids"):
    """(addr, n, keepalive): obj as n contiguous uint64 ids at addr."""
    if _is_tensor(obj) and hasattr(obj, "is_floating_point"):
        return _ids_tensor(obj, where)
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        return _ids_numpy(obj, where)
    if isinstance(obj, array.array):
        return _ids_array(obj, where)
    if isinstance(obj, (bytes, bytearray, memoryview, str)):
        raise invalid("%s: block ids must be a sequence of integers, not %s"
                      % (where, type(obj).__name__))
    if isinstance(obj, (collections.abc.Mapping, collections.abc.Set)):
        # Iterating would give a dict's keys (or a set's members in no set
        # order), paired by position with the other side's ids.
        raise invalid("%s: block ids must be a sequence of integers in order, not a %s"
                      % (where, type(obj).__name__))
    if not isinstance(obj, (list, tuple)):
        try:
            obj = list(obj)
        except TypeError:
            raise invalid("%s: block ids must be a sequence of integers, not %s"
                          % (where, type(obj).__name__)) from None
    # array.array takes True as 1: a list of flags passed where ids belong
    # would read block 1 (and block 0) instead of failing.
    if any(_is_flag(x) for x in obj):
        raise invalid("%s: block ids must be integers (got %s)" % (where, _first_bad(obj)))
    try:
        a = array.array("q", obj)
    except TypeError:
        raise invalid("%s: block ids must be integers (got %s)" % (where, _first_bad(obj))) \
            from None
    except OverflowError:
        # Ids of 2**63 and above: out of every pool, but the planner says so
        # with the region's size; negatives and beyond 2**64 stop here.
        try:
            a = array.array("Q", obj)
        except (OverflowError, TypeError):
            raise invalid("%s: block ids must lie in 0 .. 2**64-1" % where) from None
    return _ids_array(a, where)


def _is_flag(x):
    """True for Python and numpy booleans (numpy 1 names it bool_, 2 bool)."""
    t = type(x)
    return t is bool or (t.__module__ == "numpy" and t.__name__ in ("bool_", "bool"))


def _first_bad(seq):
    for x in seq:
        if not isinstance(x, int) or _is_flag(x):
            return "%r of type %s" % (x, type(x).__name__)
    return "a non-integer"
