"""The render service's allocator settings apply on glibc (this image and these tests)."""

from __future__ import annotations

import platform

import pytest

from tokenline.services.render import malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_every_setting() -> None:
    assert malloc.tune_for_tokenizing() is True
