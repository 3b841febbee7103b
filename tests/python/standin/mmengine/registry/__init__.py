"""Stand-in for mmengine.registry.Registry, with the behaviour LMDeploy's
MIGRATION_BACKENDS relies on: module_dict, and register_module used as a
decorator or with module=, refusing a taken name unless force=True."""
import inspect


class Registry:
    def __init__(self, name, build_func=None, parent=None, scope=None, locations=()):
        self._name = name
        self._module_dict = {}
        self._locations = list(locations)

    @property
    def name(self):
        return self._name

    @property
    def module_dict(self):
        return self._module_dict

    def get(self, key):
        return self._module_dict.get(key)

    def _register_module(self, module, module_name=None, force=False):
        if not inspect.isclass(module) and not inspect.isfunction(module):
            raise TypeError("module must be a class or a function, but got %s" % type(module))
        names = module_name if module_name is not None else module.__name__
        for name in [names] if isinstance(names, str) else names:
            if not force and name in self._module_dict:
                raise KeyError("%s is already registered in %s at %s"
                               % (name, self._name, self._module_dict[name].__module__))
            self._module_dict[name] = module

    def register_module(self, name=None, force=False, module=None):
        if not isinstance(force, bool):
            raise TypeError("force must be a boolean, but got %s" % type(force))
        if module is not None:
            self._register_module(module=module, module_name=name, force=force)
            return module

        def _register(module):
            self._register_module(module=module, module_name=name, force=force)
            return module
        return _register
