"""The ctypes mirrors in python/segxfer/_lib.py against the C compiler's view
(tests/python/abi_probe.c, built by make): every struct size, every field's
offset and size, every enum value the package spells out."""
import ctypes
import os
import subprocess

import pytest

from conftest import BUILD
from segxfer import _lib


@pytest.fixture(scope="module")
def probe():
    exe = os.path.join(BUILD, "tests", "python", "abi_probe")
    if not os.access(exe, os.X_OK):
        pytest.fail("%s is not built: make %s" % (exe, exe))
    structs, fields, consts = {}, {}, {}
    for line in subprocess.check_output([exe], text=True).splitlines():
        kind, name, *vals = line.split()
        if kind == "S":
            structs[name] = int(vals[0])
        elif kind == "F":
            fields[name] = (int(vals[0]), int(vals[1]))
        else:
            consts[name] = int(vals[0])
    return structs, fields, consts


def test_abi_every_struct_has_the_c_size(probe):
    structs, _, _ = probe
    assert set(structs) == set(_lib.STRUCTS)
    for name, cls in _lib.STRUCTS.items():
        assert ctypes.sizeof(cls) == structs[name], name


def test_abi_every_field_has_the_c_offset_and_size(probe):
    _, fields, _ = probe
    seen = set()
    for name, cls in _lib.STRUCTS.items():
        for field, _ in cls._fields_:
            key = "%s.%s" % (name, field)
            seen.add(key)
            desc = getattr(cls, field)
            assert (desc.offset, desc.size) == fields[key], key
    assert seen == set(fields)


def test_abi_enum_values_match(probe):
    _, _, c = probe
    for value, name in _lib.BATCH_STATES.items():
        assert c["SX_BATCH_" + name] == value
    for value, name in _lib.AGENT_STATES.items():
        assert c["SX_AGENT_" + name] == value
    assert c["SX_TRANSPORT_NONE"] == 0
    assert c["SX_TRANSPORT_TCP"] == _lib.TRANSPORT_KINDS["tcp"]
    assert c["SX_TRANSPORT_RDMA"] == _lib.TRANSPORT_KINDS["rdma"]
    assert c["SX_TRANSPORT_CUDA_IPC"] == _lib.TRANSPORT_KINDS["cuda_ipc"]
    assert (c["SX_HOST_ID_LEN"], c["SX_HOSTNAME_MAX"]) == (_lib.HOST_ID_LEN,
                                                          _lib.HOSTNAME_MAX)
    for name, value in _lib.LOG_LEVELS.items():
        assert c["SX_LOG_" + name.upper()] == value
    for value, name in _lib.MISMATCH_KINDS.items():
        assert c["SX_MISMATCH_" + name.upper()] == value
    assert (c["SX_SLOT_K"], c["SX_SLOT_V"], c["SX_SLOT_INDEX"], c["SX_SLOT_STATE"]) == \
        (_lib.SLOT_K, _lib.SLOT_V, _lib.SLOT_INDEX, _lib.SLOT_STATE)
    assert c["SX_ACCESS_REMOTE_READ"] == _lib.ACCESS_REMOTE_READ
    assert c["SX_PUBLISH_TAKEOVER"] == _lib.PUBLISH_TAKEOVER
    assert c["SX_CHECK_IGNORE_FINGERPRINT"] == _lib.CHECK_IGNORE_FINGERPRINT
    assert c["SX_ACCESS_REMOTE_WRITE"] == _lib.ACCESS_REMOTE_WRITE
    assert c["SX_BATCH_WRITE"] == _lib.BATCH_WRITE
    assert c["SX_BATCH_NOTIFY"] == _lib.BATCH_NOTIFY
    for value, name in _lib.NOTICE_KINDS.items():
        assert c["SX_NOTICE_" + name.upper()] == value
    assert c["SX_NOTICE_MAX_ENTRIES"] == _lib.NOTICE_MAX_ENTRIES
    # Codes the package tests for by value.
    assert (c["SX_EINVAL"], c["SX_ETIMEDOUT"], c["SX_ECANCELED"], c["SX_EINCOMPAT"],
            c["SX_EBUSY"]) == (-1, -10, -11, -8, -32)


def test_abi_range_write_packs_like_range_read():
    """Batch packs read and write ranges with one function."""
    for field, _ in _lib.RangeRead._fields_:
        r, w = getattr(_lib.RangeRead, field), getattr(_lib.RangeWrite, field)
        assert (r.offset, r.size) == (w.offset, w.size), field
    assert ctypes.sizeof(_lib.RangeRead) == ctypes.sizeof(_lib.RangeWrite) == 32
