"""Router plugins, one class per module: ``filters/``, ``scorers/``, ``pickers/``, ``producers/``.

Each module has a ``TYPE`` constant (the name configs use), a typed ``Params`` model with
defaults, a ``from_config(name, params)`` factory and a docstring with a config example; all are
registered in :mod:`router.plugins.register`.
"""
