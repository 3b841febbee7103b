"""The environment hook that installs segxfer's backend in SGLang
(python/segxfer-sglang.pth and python/_segxfer_sglang_hook.py), in fresh
interpreters as SGLang's processes are: the .pth is processed by site (as
for an installed package), SGLang's disaggregation/utils.py is the
stand-in in tests/python/sglang_standin (its shape: TransferBackend,
KVClassType, get_kv_class's closed if/elif).

Asserted: with SEGXFER_SGLANG=mooncake, get_kv_class(MOONCAKE, X) gives
segxfer's class for every KVClassType and other backends SGLang's own;
without it nothing changes; where SGLang is absent, or the value is not a
backend name, the interpreter starts with no error (a warning for a bad
value) and segxfer is not even imported.
"""
import json
import os
import subprocess
import sys

from conftest import ROOT

PYDIR = os.path.join(ROOT, "python")
STANDIN = os.path.join(ROOT, "tests", "python", "sglang_standin")

PROBE = """
import json, site, sys
site.addsitedir(%r)          # processes segxfer-sglang.pth, as at startup
out = {"segxfer_loaded": "segxfer" in sys.modules}
if %r:
    sys.path.insert(0, %r)
    from sglang.srt.disaggregation.utils import get_kv_class, TransferBackend, KVClassType
    out["mooncake"] = {t.value: get_kv_class(TransferBackend.MOONCAKE, t).__name__
                       for t in KVClassType}
    out["nixl"] = get_kv_class(TransferBackend.NIXL, KVClassType.SENDER).__name__
    out["segxfer_loaded_after"] = "segxfer" in sys.modules
else:
    try:
        import sglang
        out["sglang"] = True
    except ImportError:
        out["sglang"] = False
print(json.dumps(out))
"""


def probe(env_value, with_sglang=True):
    env = dict(os.environ)
    env.pop("SEGXFER_SGLANG", None)
    if env_value is not None:
        env["SEGXFER_SGLANG"] = env_value
    env["SEGXFER_SGLANG_STANDIN"] = "1"
    p = subprocess.run([sys.executable, "-c", PROBE % (PYDIR, with_sglang, STANDIN)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_sglang_hook_installs_segxfer_for_the_named_backend():
    out, err = probe("mooncake")
    assert not out["segxfer_loaded"]          # nothing loaded until SGLang asks
    assert out["mooncake"] == {"kvargs": "KVArgs", "manager": "SegxferKVManager",
                               "sender": "SegxferKVSender", "receiver": "SegxferKVReceiver",
                               "bootstrap_server": "SegxferKVBootstrapServer"}
    assert out["nixl"] == "nixl_sender"       # other backends: SGLang's own
    assert err == ""


def test_sglang_hook_changes_nothing_without_the_setting():
    out, err = probe(None)
    assert out["mooncake"]["sender"] == "mooncake_sender"
    assert not out["segxfer_loaded_after"] and err == ""


def test_sglang_hook_is_harmless_without_sglang():
    out, err = probe("mooncake", with_sglang=False)
    assert out == {"segxfer_loaded": False, "sglang": False} and err == ""


def test_sglang_hook_warns_on_a_bad_name_and_leaves_sglang_alone():
    out, err = probe("moon cake!")
    assert out["mooncake"]["sender"] == "mooncake_sender"
    assert "not a transfer backend name" in err


def test_sglang_hook_warns_on_a_backend_sglang_never_asks_for():
    out, err = probe("segxfer")
    assert out["mooncake"]["sender"] == "mooncake_sender"
    assert "never asks for 'segxfer'" in err
