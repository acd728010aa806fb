"""Unit conversions shared by every part of tessel (defined once here)."""

from __future__ import annotations

GIB = 1024**3  # bytes in one GiB
BITS_PER_BYTE = 8
GBPS = 1e9 / BITS_PER_BYTE  # bytes/s in one Gbit/s: cluster and plan files give bandwidth in Gbit/s
US_PER_S = 1e6  # microseconds in one second
