"""The test helper tests/eventlogs.py: its fast template writer gives the same records as the
plain one (the 1 GiB log of tests/e2e/test_outputs.py is written with it)."""

from __future__ import annotations

import functools
import io

import msgpack

from tests import eventlogs


def test_the_fast_node_log_holds_the_records_of_the_node_mix():
    # The 1 GiB log (tests/e2e/test_outputs.py) is written from templates: the same
    # records, decoded.
    for iterations in (0, 1, 3, 7):
        plain, fast = io.BytesIO(), io.BytesIO()
        eventlogs.write(plain, eventlogs.node_records(iterations))
        eventlogs.write_node_log(fast, iterations)
        decode = functools.partial(msgpack.Unpacker, raw=False, strict_map_key=False)
        assert list(decode(io.BytesIO(fast.getvalue()))) == list(
            decode(io.BytesIO(plain.getvalue())))
