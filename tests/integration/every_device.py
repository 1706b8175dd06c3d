"""Checks that read every device's copy of a tensor.

`Client.get` reads one copy of each tile, so a test that checks a replicated result, or
a reshard to replicas, with `get` alone passes whatever the other copies hold.
"""

from __future__ import annotations

import numpy as np


def assert_every_device(client, name: str, array, sharding=None) -> None:
    """Every device of ``name``'s sharding (the catalog's, unless ``sharding`` is given, which must then be it)
    holds its tile of ``array`` (a numpy array or a torch tensor), bit for bit and in its dtype."""
    held = client.info(name).sharding
    if sharding is not None:
        assert held == sharding, f"{name!r} is held as {held}, not {sharding}"
    assert not held.is_partial, f"{name!r} is a pending sum ({held}): its devices hold addends, not tiles"
    wrong = []
    for dev, box in held.tiles(tuple(array.shape)).items():
        want = _described(array[tuple(slice(lo, hi) for lo, hi in box)])
        got = _described(client.get_shard(name, dev))
        if got != want:
            wrong.append(f"{dev} (tile {box}: got {got[0]}{list(got[1])})")
    assert not wrong, f"{name!r} differs from the expected array on {len(wrong)} device(s): {', '.join(wrong)}"


def _described(x) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, bytes) of a numpy array or a torch tensor (bfloat16 and float8 included, as their bits)."""
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().cpu().contiguous()
        return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()
    a = np.ascontiguousarray(x)
    return str(a.dtype), a.shape, a.tobytes()
