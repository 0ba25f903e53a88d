"""The startup benchmark's pool: endpoints/8 Pods at distinct loopback addresses, 8 target ports."""

from __future__ import annotations

import os

import pytest

from picker_bench.startup import PoolLayout, cpu_seconds


def test_a_pool_of_1024_endpoints_is_128_distinct_pods_of_8_ports() -> None:
    layout = PoolLayout(1024)
    assert len(layout.pod_ips) == len(set(layout.pod_ips)) == 128
    assert len(layout.ports) == 8
    assert len(set(layout.addresses)) == 1024
    assert all(ip.startswith("127.0.") for ip in layout.pod_ips)


@pytest.mark.parametrize("endpoints", [0, 12, -8])
def test_the_pool_size_is_a_positive_multiple_of_8(endpoints: int) -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        PoolLayout(endpoints)


def test_cpu_seconds_are_this_processs_cpu_time() -> None:
    spent = sum(os.times()[:2])
    assert abs(cpu_seconds(os.getpid()) - spent) < 0.1
