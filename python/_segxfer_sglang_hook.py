"""segxfer's SGLang transfer backend in SGLang processes nobody patches.

SGLang picks its KV transfer backend with a closed if/elif on the
TransferBackend enum (get_kv_class in python/sglang/srt/disaggregation/
utils.py of sgl-project/sglang, 000eaffa), called in the scheduler process
of every rank and in the HTTP server (for the bootstrap server), which
SGLang starts as fresh interpreters.  `make install` puts segxfer-sglang.pth
beside the package; its one line imports this module at interpreter start
only when SEGXFER_SGLANG is set, and install() then waits, at no cost, for
SGLang's disaggregation/utils.py to be imported and wraps its get_kv_class:

    SEGXFER_SGLANG=mooncake    SGLang's --disaggregation-transfer-backend
                               mooncake gets segxfer's manager, sender,
                               receiver and bootstrap server (nixl, ascend:
                               likewise; the flag only takes SGLang's names)

Other backends go to SGLang's own get_kv_class unchanged.  Nothing here may
stop an interpreter from starting or SGLang from importing: a bad value or a
failed patch is a warning on stderr; where SGLang is not installed nothing
happens at all (the finder is never asked).  This module imports nothing of
segxfer (whose import loads the library) until SGLang asks for the backend.
The import-hook machinery is _segxfer_hook's (installed beside it).
"""
import os
import re

from _segxfer_hook import _warn, install_setting, setting_name, when_imported

SGLANG_UTILS = "sglang.srt.disaggregation.utils"
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def backend_name(value):
    """The TransferBackend value SEGXFER_SGLANG names, or None (with a
    warning) when it is not one SGLang could be asked for."""
    return setting_name("SEGXFER_SGLANG", value, _NAME, "transfer backend name (e.g. "
                        "mooncake, the value of SGLang's --disaggregation-transfer-backend)",
                        "segxfer's backend is not installed", fold=True)


def patch(module, name):
    """Wrap module.get_kv_class so that backend `name` gets segxfer's
    classes.  Failures are warnings."""
    try:
        original = module.get_kv_class
        if getattr(original, "_segxfer_backend", None) is not None:
            return
        known = [b.value for b in getattr(module, "TransferBackend", ())]
        if known and name not in known:
            _warn("SEGXFER_SGLANG=%s: SGLang's transfer backends are %s; "
                  "--disaggregation-transfer-backend never asks for %r"
                  % (name, ", ".join(known), name))

        def get_kv_class(transfer_backend, class_type):
            if getattr(transfer_backend, "value", transfer_backend) != name:
                return original(transfer_backend, class_type)
            try:
                from segxfer.sglang import get_kv_class as segxfer_class
            except Exception as e:  # noqa: BLE001  (say why where SGLang asks)
                raise ImportError("SEGXFER_SGLANG=%s: the segxfer package cannot be loaded "
                                  "(%s: %s)" % (name, type(e).__name__, e)) from e
            return segxfer_class(class_type)

        get_kv_class._segxfer_backend = name
        get_kv_class.__wrapped__ = original
        module.get_kv_class = get_kv_class
    except Exception as e:  # noqa: BLE001  (SGLang must still import)
        _warn("SEGXFER_SGLANG=%s: could not install segxfer's backend in SGLang (%s: %s)"
              % (name, type(e).__name__, e))


def install(environ=os.environ):
    """Read SEGXFER_SGLANG and arrange the patch (segxfer-sglang.pth calls
    this at interpreter start)."""
    install_setting("SEGXFER_SGLANG", backend_name, lambda name: when_imported(
        SGLANG_UTILS, lambda m: patch(m, name), "SEGXFER_SGLANG"), environ)
