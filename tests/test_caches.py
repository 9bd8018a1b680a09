"""mhattn.caches.put_bounded: the insertion every bounded cache of the call path uses."""

from mhattn.caches import put_bounded


def test_the_oldest_entry_makes_room_and_the_value_is_returned():
    cache = {}
    for i in range(5):
        assert put_bounded(cache, f"k{i}", i, limit=3) == i
    assert list(cache) == ["k2", "k3", "k4"]  # at most 3 entries, the oldest gone first
    put_bounded(cache, "k3", 33, limit=3)   # an existing key: replaced in place after one eviction
    assert cache["k3"] == 33 and len(cache) <= 3


def test_a_cache_emptied_meanwhile_only_skips_the_eviction():
    class Emptied(dict):
        def __len__(self):  # claims to be full, holds nothing (another thread cleared it meanwhile)
            return 10

    cache = Emptied()
    assert put_bounded(cache, "key", "value", limit=2) == "value" and dict(cache) == {"key": "value"}
