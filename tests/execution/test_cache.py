"""Cache kinds (execution/cache.py): the flag words and the backends they build."""
from __future__ import annotations

import pytest

import main as weft_main
from execution.cache import CacheKind, ClassicCache, LRUCache, NoCache, RAMPressureCache, make_cache


@pytest.mark.parametrize("flags, backend, kind", [
    (["--cache-classic"], ClassicCache, CacheKind.CLASSIC),
    (["--cache-lru", "7"], LRUCache, CacheKind.LRU),
    (["--cache-none"], NoCache, CacheKind.NONE),
    (["--cache-ram", "2"], RAMPressureCache, CacheKind.RAM),
    ([], RAMPressureCache, CacheKind.RAM),
])
def test_flags_build_their_backend(flags, backend, kind):
    parser = weft_main.argparse.ArgumentParser()
    weft_main.add_common_arguments(parser)
    cache = weft_main.cache_from_args(parser.parse_args(flags))
    assert type(cache) is backend and cache.kind is kind
    assert f"--cache-{kind.value}" in {"--cache-classic", "--cache-lru", "--cache-ram", "--cache-none"}


def test_kind_words_and_settings():
    assert make_cache("lru", lru_size=3).max_entries == 3
    assert make_cache(CacheKind.RAM, ram_gb=1.5).min_free_bytes == int(1.5 * 2**30)
    with pytest.raises(ValueError, match="unknown cache kind 'disk'"):
        make_cache("disk")
