"""The engine's own streams, without a device: the CUDA driver and torch's stream wrappers are
stand-ins, so what is checked is the ownership logic: three streams (one per direction and one
for index copies) created for the engine alone, checked distinct from the process's streams,
destroyed when creating them failed (nothing used them), and kept at close for the next engine
on the device, never destroyed (torch may record events on them after the close)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsa_async.kinds import Direction
from dsa_async.transfer import copy_streams, cuda_driver
from dsa_async.transfer.copy_streams import CopyStreamError, CopyStreams

LEAST, GREATEST = 0, -5


class FakeStream:
    def __init__(self, handle: int, device=None) -> None:
        self.cuda_stream = handle
        self.device = device


class Driver:
    """Stand-in for cuda_driver: hands out fresh handles and records what is destroyed."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.next = itertools.count(0x1000)
        self.created: list[tuple[int, int]] = []  # (handle, priority)
        self.destroyed: list[int] = []
        self.fail_at = fail_at

    def create_stream(self, ordinal: int, priority: int) -> int:
        if self.fail_at is not None and len(self.created) == self.fail_at:
            raise cuda_driver.CudaDriverError("out of resources")
        handle = next(self.next)
        self.created.append((handle, priority))
        return handle

    def destroy_stream(self, ordinal: int, handle: int) -> None:
        self.destroyed.append(handle)


@pytest.fixture
def driver(monkeypatch):
    def install(fail_at=None, current=0x1, default=0x0):
        fake = Driver(fail_at)
        monkeypatch.setattr(copy_streams, "_SPARE", {})  # no other test's streams
        monkeypatch.setattr(cuda_driver, "stream_priority_range",
                            lambda ordinal: (LEAST, GREATEST))
        monkeypatch.setattr(cuda_driver, "create_stream", fake.create_stream)
        monkeypatch.setattr(cuda_driver, "destroy_stream", fake.destroy_stream)
        monkeypatch.setattr(copy_streams.torch.cuda, "ExternalStream", FakeStream)
        monkeypatch.setattr(copy_streams.torch.cuda, "current_stream",
                            lambda device=None: FakeStream(current))
        monkeypatch.setattr(copy_streams.torch.cuda, "default_stream",
                            lambda device=None: FakeStream(default))
        return fake
    return install


def test_three_distinct_streams_of_the_engine_kept_at_close_for_the_next_engine(driver):
    fake = driver()
    streams = CopyStreams.create(torch.device("cuda", 0))
    handles = {*streams.handles.values(), int(streams.index.cuda_stream)}
    assert len(handles) == 3 and handles == {h for h, _ in fake.created}
    priorities = dict(fake.created)
    assert priorities[int(streams.index.cuda_stream)] == GREATEST  # a load waits for its indices
    assert priorities[streams.handles[Direction.H2D]] == GREATEST
    assert priorities[streams.handles[Direction.D2H]] == LEAST
    other = CopyStreams.create(torch.device("cuda", 0))  # two open engines: six streams
    assert len(fake.created) == 6 and not handles & set(other._own_handles().values())
    streams.retire()
    assert fake.destroyed == []
    again = CopyStreams.create(torch.device("cuda", 0))  # the closed engine's, same roles
    assert len(fake.created) == 6 and again._own_handles() == streams._own_handles()
    assert CopyStreams.create(torch.device("cuda", 1))._own_handles() != streams._own_handles()
    assert len(fake.created) == 9  # spare streams stay on their device
    other.retire()
    again.retire()
    assert fake.destroyed == []


def test_spare_streams_that_clash_are_put_back_not_destroyed(driver):
    fake = driver(current=0x77)
    copy_streams._SPARE[0] = [(0x75, 0x76, 0x77)]  # a closed engine's streams
    with pytest.raises(CopyStreamError, match="the index copy stream 0x77 is also"):
        CopyStreams.create(torch.device("cuda", 0))
    assert fake.destroyed == [] and fake.created == []
    assert copy_streams._SPARE[0] == [(0x75, 0x76, 0x77)]


def test_an_index_stream_that_is_the_callers_is_refused_and_every_stream_destroyed(driver):
    fake = driver(current=0x1002)  # the third stream made: the index stream
    with pytest.raises(CopyStreamError, match="the index copy stream 0x1002 is also"):
        CopyStreams.create(torch.device("cuda", 0))
    assert sorted(fake.destroyed) == [h for h, _ in fake.created]


def test_a_failed_creation_destroys_the_streams_already_made(driver):
    fake = driver(fail_at=2)  # the index stream cannot be made
    with pytest.raises(CopyStreamError, match="could not create the copy streams"):
        CopyStreams.create(torch.device("cuda", 0))
    assert sorted(fake.destroyed) == [h for h, _ in fake.created] and len(fake.created) == 2
