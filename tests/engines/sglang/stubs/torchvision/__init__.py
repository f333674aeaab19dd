"""Import-only stub of torchvision.

PyPI's torchvision wheels are CUDA builds whose _C.so needs libtorch_cuda.so, so they cannot load
beside the CPU torch 2.13.0 wheel ("operator torchvision::nms does not exist"). SGLang imports
torchvision.transforms at module-import time from multimodal config helpers, and transformers imports
torchvision.io / transforms.v2 once it sees torchvision. KV-cache code never calls any of it.
Every torchvision.* submodule resolves to a stub module; every attribute is a stub class whose use raises.
"""

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0+stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _make_stub(qualname):
    class _Stub:
        def __init__(self, *a, **k):
            raise RuntimeError(f"torchvision stub: {qualname} is not available")

        def __class_getitem__(cls, item):
            return cls

    _Stub.__name__ = _Stub.__qualname__ = qualname.rsplit(".", 1)[-1]
    return _Stub


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        val = _make_stub(full)
        setattr(self, name, val)
        return val


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return importlib.import_module(f"torchvision.{name}")
