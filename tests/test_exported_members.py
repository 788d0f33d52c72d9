from __future__ import annotations

import agentkv
import agentkv.protocol
import agentkv.sim


def test_all_is_sorted_and_complete():
    for module in (agentkv, agentkv.protocol, agentkv.sim):
        names = [n for n in module.__all__ if n != "__version__"]
        assert names == sorted(names), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_public_objects_present_as_agentkv():
    assert agentkv.Client.__module__ == "agentkv"
    assert agentkv.TurnReceipt.__module__ == "agentkv"
