"""KVSERVE_REQUIRE_KERNELS=1: a C kernel that cannot be built is an error, not a quiet fallback
(so under `make test` a missing compiler fails the kernels' tests instead of skipping them)."""
from __future__ import annotations

import pytest

from kvserve import kernels


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.delenv("KVSERVE_NO_KERNELS", raising=False)


def test_without_the_setting_a_missing_kernel_falls_back(broken_compiler, monkeypatch):
    monkeypatch.delenv("KVSERVE_REQUIRE_KERNELS", raising=False)
    assert kernels._load("argmax") is None


def test_with_the_setting_a_missing_kernel_is_an_error(broken_compiler, monkeypatch):
    monkeypatch.setenv("KVSERVE_REQUIRE_KERNELS", "1")
    with pytest.raises(RuntimeError, match="KVSERVE_REQUIRE_KERNELS=1 and the C kernel argmax is unavailable"):
        kernels._load("argmax")
