"""Registration of segxfer's engine backends in processes nobody patches.

LMDeploy builds its migration backend inside the engine process, by name
(`MIGRATION_BACKENDS.module_dict[cache_config.migration_backend.name]()` in
lmdeploy/pytorch/engine/cache_engine.py), in a process it spawns and, for
TP > 1, in Ray workers.  A `register_module` call in the launching script
reaches none of them; the environment does.  `make install` puts
segxfer.pth next to the package; its one line imports this module at
interpreter start only when SEGXFER_LMDEPLOY is set, and install() then
waits, at no cost, for LMDeploy's backend package to be imported:

    SEGXFER_LMDEPLOY=Mooncake    register segxfer's backend as "Mooncake"
                                 (what `--migration-backend Mooncake` asks for)

The name is registered with force=True right after
lmdeploy.pytorch.disagg.backend has run its own registrations, so it
replaces LMDeploy's backend of that name.  Nothing here may stop an
interpreter from starting or LMDeploy from importing: a bad value or a
failed registration is a warning on stderr.  Where lmdeploy is not installed
nothing happens at all (the finder is never asked).

This module imports nothing of segxfer (whose import loads the library)
until LMDeploy's package is imported.

It is also the machinery of every such hook (_segxfer_sglang_hook.py uses
it for SEGXFER_SGLANG): setting_name() reads a setting's backend name,
when_imported() runs a function right after a module's own code once it is
imported, without importing it.  It must stay importable alone (a site
directory may hold only it and segxfer.pth) and import nothing else of
segxfer's.
"""
import os
import re
import sys

LMDEPLOY_PACKAGE = "lmdeploy.pytorch.disagg.backend"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _warn(message):
    try:
        sys.stderr.write("segxfer: %s\n" % message)
    except Exception:  # noqa: BLE001  (no stderr: nothing to say it on)
        pass


def setting_name(setting, value, pattern, example, undone, fold=False):
    """The backend name a setting gives (stripped; lower-cased with fold),
    or None with a warning "<setting>=<value> is not a <example>: <undone>"
    when pattern does not match all of it."""
    name = (value or "").strip()
    name = name.lower() if fold else name
    if not pattern.match(name):
        _warn("%s=%r is not a %s: %s" % (setting, value, example, undone))
        return None
    return name


def lmdeploy_name(value):
    """The backend name SEGXFER_LMDEPLOY gives, or None (with a warning)
    when it is not one LMDeploy could ask for."""
    return setting_name("SEGXFER_LMDEPLOY", value, _NAME, "backend name (e.g. Mooncake, the "
                        "value of LMDeploy's --migration-backend)",
                        "segxfer's backend is not registered")


class _Loader:
    """The module's own loader, with after(module) run after it."""

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
    """On sys.meta_path: finds nothing itself; when module `fullname` is
    about to load, it wraps the loader the other finders give.  setting
    names the hook in warnings."""

    def __init__(self, fullname, after, setting):
        self.fullname, self.after, self.setting = fullname, after, setting

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        # Once is enough (and the finders asked below must not find us).
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
            _warn("%s has a loader segxfer cannot follow (%r): %s is not applied"
                  % (fullname, spec.loader, self.setting))
        return spec


def when_imported(fullname, after, setting):
    """Run after(module) right after module fullname's own code: now if it
    is imported already, else from a finder that waits for its import (one
    per module; the first hook for it wins)."""
    if fullname in sys.modules:
        after(sys.modules[fullname])
    elif not any(isinstance(f, _Finder) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(fullname, after, setting))


def install_setting(setting, parse, apply, environ):
    """Read setting from environ; if it names a backend (parse), arrange
    apply(name) (see install()).  Nothing raises: interpreter start goes on."""
    try:
        value = environ.get(setting)
        if value is None:
            return
        name = parse(value)
        if name is not None:
            apply(name)
    except Exception as e:  # noqa: BLE001  (interpreter start must go on)
        _warn("%s: %s: %s" % (setting, type(e).__name__, e))


def register_lmdeploy(name):
    """Register segxfer's backend in LMDeploy's MIGRATION_BACKENDS as name
    (replacing LMDeploy's own of that name).  Failures are warnings."""
    try:
        import importlib
        registry = importlib.import_module(LMDEPLOY_PACKAGE + ".backend").MIGRATION_BACKENDS
        try:
            from segxfer.lmdeploy_backend import SegxferMigrationBackend as backend
        except Exception as e:  # noqa: BLE001  (e.g. libsegxfer.so not found)
            reason = "%s: %s" % (type(e).__name__, e)

            # LMDeploy builds the backend later, in p2p_initialize: that is
            # where the engine says why segxfer is missing, not at import.
            def backend():
                raise ImportError("SEGXFER_LMDEPLOY=%s: the segxfer package cannot be "
                                  "loaded (%s)" % (name, reason))
        registry.register_module(name=name, force=True, module=backend)
        known = getattr(sys.modules.get("lmdeploy.pytorch.disagg.config"), "MigrationBackend",
                        None)
        if known is not None and name not in getattr(known, "__members__", {name: 0}):
            _warn("SEGXFER_LMDEPLOY=%s: LMDeploy asks for one of %s (--migration-backend), "
                  "never for %r" % (name, ", ".join(known.__members__), name))
    except Exception as e:  # noqa: BLE001  (LMDeploy must still import)
        _warn("SEGXFER_LMDEPLOY=%s: could not register segxfer's backend in LMDeploy "
              "(%s: %s)" % (name, type(e).__name__, e))


def install(environ=os.environ):
    """Read SEGXFER_LMDEPLOY and arrange the registration (segxfer.pth
    calls this at interpreter start)."""
    install_setting("SEGXFER_LMDEPLOY", lmdeploy_name, lambda name: when_imported(
        LMDEPLOY_PACKAGE, lambda _: register_lmdeploy(name), "SEGXFER_LMDEPLOY"), environ)
