"""The elements of a JSON array one at a time (perfmon.parsers.json_stream): what json.loads
gives, whatever the chunks; one error for what is not one array; reading stops at its cap."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from perfmon.parsers import json_stream
from perfmon.parsers.json_stream import JsonStreamError, JsonTooLarge, iter_json_array

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(JSON, max_size=8), st.sampled_from([None, 0, 2]), st.integers(1, 9))
def test_the_stream_gives_what_json_loads_gives_whatever_the_chunk_boundaries(
        values, indent, chunk):
    text = json.dumps(values, indent=indent, ensure_ascii=False)
    old, json_stream.CHUNK_BYTES = json_stream.CHUNK_BYTES, chunk
    try:
        assert list(iter_json_array(io.BytesIO(text.encode()))) == values
        assert list(iter_json_array(text.encode())) == values
        assert list(iter_json_array(text)) == values
    finally:
        json_stream.CHUNK_BYTES = old


@pytest.mark.parametrize("text", ["", "{}", "[1,", "[1 2]", "[1]x", "[{]", "[" * 100_000])
def test_a_stream_that_is_not_one_json_array_raises_its_error(text):
    with pytest.raises(JsonStreamError):
        list(iter_json_array(text.encode()))


def test_a_stream_stops_reading_at_max_bytes(monkeypatch):
    monkeypatch.setattr(json_stream, "CHUNK_BYTES", 4096)
    data = json.dumps(list(range(100_000))).encode()
    seen = []
    with pytest.raises(JsonTooLarge):
        for value in iter_json_array(io.BytesIO(data), max_bytes=100_000):
            seen.append(value)
    assert 0 < len(seen) < 100_000 and seen == list(range(len(seen)))
