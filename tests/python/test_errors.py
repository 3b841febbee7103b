"""Every code of the C error table is a Python exception class named after it,
and real failing calls raise the right one with the library's message."""
import os
import re

import pytest

import segxfer
from conftest import LAYOUT, ROOT, Pair, register_kv
from segxfer import errors


def c_table():
    """(name, value, text) of every line of SX_ERRNO_MAP in the header."""
    with open(os.path.join(ROOT, "include", "segxfer", "errors.h")) as f:
        text = f.read()
    return [("SX_E" + m.group(1), int(m.group(2)), m.group(3))
            for m in re.finditer(r'XX\((\w+), (-\d+), "([^"]*)"\)', text)]


def test_errors_every_code_has_its_class():
    table = c_table()
    assert len(table) >= 38
    for name, value, text in table:
        cls = getattr(segxfer, name)
        assert cls.__name__ == name
        assert cls.code == value and cls.name == name
        assert issubclass(cls, segxfer.SegxferError)
        assert segxfer.CODES[value] is cls
        exc = errors.error(value, "what failed")
        assert type(exc) is cls
        assert exc.message == "what failed" and exc.strerror == text
        assert str(exc) == "what failed (%s)" % name
        # Without a message, the fixed text.
        assert errors.error(value).message == text
    assert set(segxfer.CODES) == {v for _, v, _ in table}


def test_errors_builtin_bases_and_unknown_codes():
    assert issubclass(segxfer.SX_EINVAL, ValueError)
    assert issubclass(segxfer.SX_ETIMEDOUT, TimeoutError)
    assert issubclass(segxfer.IncompatibleLayout, segxfer.SX_EINCOMPAT)
    exc = errors.error(-999, "odd")
    assert type(exc) is segxfer.SegxferError and exc.code == -999
    assert exc.name == "SX_UNKNOWN"


def test_errors_real_calls_raise_their_codes(url, redis):
    with pytest.raises(segxfer.SX_EURL) as e:
        segxfer.Agent(None, "nosuch://127.0.0.1", log_level="error")
    assert "nosuch" in str(e.value)
    with pytest.raises(segxfer.SX_ENAME) as e:
        segxfer.Agent("/starts-with-slash", url, log_level="error")
    assert e.value.message
    closed_port = "redis://127.0.0.1:1?namespace=x&timeout_ms=300"
    with pytest.raises(segxfer.SX_EUNREACH) as e:
        segxfer.Agent(None, closed_port, log_level="error")
    assert "127.0.0.1:1" in str(e.value)

    p = Pair(url, name="held-0")
    try:
        with pytest.raises(segxfer.SX_ENOENT) as e:
            p.reader.open("no-such-segment", timeout=0.2)
        assert "no-such-segment" in str(e.value)
        # A second live agent under the same name.
        with segxfer.Agent("held-0", url, log_level="error", **LAYOUT) as twin:
            register_kv(twin, 4)
            with pytest.raises(segxfer.SX_EHELD) as e:
                twin.publish()
            assert "incarnation" in str(e.value)
        with pytest.raises(segxfer.SX_ESTRIDE):
            p.reader.register(bytearray(8192), group=5, block_bytes=4096, block_stride=1024)
        with pytest.raises(segxfer.SX_EOVERLAP):
            p.reader.register(bytearray(8192), layers=1, slot="K", block_bytes=4096)
        with pytest.raises(segxfer.SX_ENOREGION):
            p.reader.unregister(12345)
        with p.reader.open("held-0") as seg:
            with pytest.raises(segxfer.SX_EBOUNDS) as e:
                seg.read_blocks([40], [0])
            assert "outside region" in str(e.value)
            with pytest.raises(segxfer.SX_ENOREGION) as e:
                seg.read_blocks([1], [1], layers=(0, 9))
            assert "layer 3" in str(e.value)
    finally:
        p.close()
