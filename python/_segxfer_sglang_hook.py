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
"""
import os
import re
import sys

SGLANG_UTILS = "sglang.srt.disaggregation.utils"
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def _warn(message):
    try:
        sys.stderr.write("segxfer: %s\n" % message)
    except Exception:  # noqa: BLE001  (no stderr: nothing to say it on)
        pass


def backend_name(value):
    """The TransferBackend value SEGXFER_SGLANG names, or None (with a
    warning) when it is not one SGLang could be asked for."""
    name = (value or "").strip().lower()
    if not _NAME.match(name):
        _warn("SEGXFER_SGLANG=%r is not a transfer backend name (e.g. mooncake, the value "
              "of SGLang's --disaggregation-transfer-backend): segxfer's backend is not "
              "installed" % value)
        return None
    return name


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


class _Loader:
    """The module's own loader, with the patch run after it."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, attr):
        return getattr(self._loader, attr)


class _Finder:
    """On sys.meta_path: finds nothing itself; when SGLang's
    disaggregation/utils.py is about to load, wraps the loader the other
    finders give."""

    def __init__(self, fullname, after):
        self.fullname, self.after = fullname, after

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self.after)
        else:
            _warn("%s has a loader segxfer cannot follow (%r): SEGXFER_SGLANG is not "
                  "applied" % (fullname, spec.loader))
        return spec


def install(environ=os.environ):
    """Read SEGXFER_SGLANG and arrange the patch (segxfer-sglang.pth calls
    this at interpreter start)."""
    try:
        value = environ.get("SEGXFER_SGLANG")
        if value is None:
            return
        name = backend_name(value)
        if name is None:
            return
        if SGLANG_UTILS in sys.modules:
            patch(sys.modules[SGLANG_UTILS], name)
        elif not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder(SGLANG_UTILS, lambda m: patch(m, name)))
    except Exception as e:  # noqa: BLE001  (interpreter start must go on)
        _warn("SEGXFER_SGLANG: %s: %s" % (type(e).__name__, e))
