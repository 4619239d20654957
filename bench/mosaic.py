"""mosaicml-streaming beside torch 2.13.0+cpu, for the peers benchmarks (peers.py,
remote_peers.py) and scripts/peers_setup.sh's import check: it imports torchvision, which
does not load there, so stand-ins are registered first."""

from __future__ import annotations

import sys
from typing import Any


def torchvision_stand_in() -> None:
    """mosaicml-streaming imports torchvision at package import (its vision datasets subclass
    VisionDataset and import to_tensor), and torchvision does not load beside torch 2.13.0+cpu.
    MDSWriter and StreamingDataset never use it: register stand-ins for the three modules. They
    carry a spec because transformers (imported by streaming) probes torchvision with find_spec;
    with no distribution metadata behind it, transformers then counts torchvision as absent."""
    import types
    from importlib.machinery import ModuleSpec

    if "torchvision" in sys.modules:
        return

    def unavailable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("torchvision stand-in: not installed in the peers' venv")

    attrs = {
        "torchvision": {},
        "torchvision.datasets": {"VisionDataset": type("VisionDataset", (), {})},
        "torchvision.transforms": {},
        "torchvision.transforms.functional": {"to_tensor": unavailable},
    }
    for name, names in attrs.items():
        module = types.ModuleType(name)
        module.__spec__ = ModuleSpec(name, None, is_package=name != "torchvision.transforms.functional")
        module.__dict__.update(names)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def import_streaming() -> Any:
    torchvision_stand_in()
    import streaming
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # a killed earlier run must not leave this one hanging
    return streaming
