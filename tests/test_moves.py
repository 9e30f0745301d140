"""`lower/moves.py`: a value moved a piece per receiving device (what crosses between
processes whose stages hold unequal device counts), checked in one process."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from hapsynth.lower.moves import _by_pieces, broadcast, everywhere, move


def _mesh(ids):
    devices = jax.devices()
    return Mesh(np.array([devices[i] for i in ids]), ("data",))


CASES = [  # (sender's devices, its spec, receiver's devices, its spec)
    ((0, 1), PS(), (2, 3, 4, 5, 6, 7), PS("data")),        # whole -> split over 6
    ((0, 1), PS("data"), (2, 3, 4), PS()),                  # split -> whole: gathered
    ((0, 1, 2, 3, 4, 5), PS(None, "data"), (6, 7), PS(None, "data")),
    ((0, 1), PS(), (1, 2, 3), PS()),                         # overlapping ends
    ((0,), PS(), (4, 5), PS()),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_value_moved_by_pieces_is_the_value_laid_out_as_asked(case):
    src_ids, src_spec, dst_ids, dst_spec = CASES[case]
    x = np.arange(12 * 12, dtype=np.float32).reshape(12, 12)
    a = jax.device_put(x, NamedSharding(_mesh(src_ids), src_spec))
    dst = NamedSharding(_mesh(dst_ids), dst_spec)
    got = _by_pieces(a, dst)
    assert got.sharding == dst
    np.testing.assert_array_equal(np.asarray(got), x)
    want = {d: np.asarray(x[i]) for d, i in dst.devices_indices_map(x.shape).items()}
    for sh in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(sh.data), want[sh.device])
    np.testing.assert_array_equal(np.asarray(move(a, dst)), x)


def test_a_scalar_moves_by_pieces():
    a = jax.device_put(np.float32(3.5), NamedSharding(_mesh((0, 1)), PS()))
    got = _by_pieces(a, NamedSharding(_mesh((2, 3, 4)), PS()))
    assert float(got) == 3.5 and len(got.addressable_shards) == 3


def test_one_process_broadcasts_and_gathers_as_it_is():
    x = np.arange(6.0)
    np.testing.assert_array_equal(broadcast(x), x)
    a = jax.device_put(x, NamedSharding(_mesh((0, 1, 2)), PS("data")))
    assert everywhere(a) is a
