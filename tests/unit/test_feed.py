"""transfer.chunks.Feed: the chunks a streamed dump hands a sender, kept until acknowledged,
at most ``limit`` bytes of them (the producer waits beyond), their memory reused, and a producer
never left waiting once the transfer has ended."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from transfer.api import TransferError
from transfer.chunks import Feed, Files, SendState

CHUNK = 1 << 16


def _view(data: bytes) -> memoryview:
    return memoryview(data)


def test_chunks_are_kept_until_released_and_their_memory_reused() -> None:
    feed = Feed(CHUNK, 2 * CHUNK)
    feed.put("pages-1.img", 0, _view(b"a" * CHUNK))
    feed.put("pages-1.img", CHUNK, _view(b"b" * 10))
    feed.put("empty.img", 0, _view(b""))
    assert feed.take() == [("pages-1.img", 0, CHUNK), ("pages-1.img", CHUNK, 10), ("empty.img", 0, 0)]
    assert feed.take() == []
    buf = bytearray(CHUNK)
    assert feed.read_into("pages-1.img", CHUNK, buf) == 10 and buf[:10] == b"b" * 10
    first = feed.kept[("pages-1.img", 0)].obj
    feed.release("pages-1.img", 0)
    assert feed.read_into("pages-1.img", 0, buf) is None  # (acknowledged: gone)
    feed.put("pages-2.img", 0, _view(b"c" * 100))
    assert feed.kept[("pages-2.img", 0)].obj is first  # the released buffer, not fresh memory
    assert feed.fed == CHUNK + 10 + 100


def test_a_full_feed_holds_the_producer_until_a_release_or_the_end() -> None:
    feed = Feed(CHUNK, 2 * CHUNK)
    feed.put("p", 0, _view(b"x" * CHUNK))
    feed.put("p", CHUNK, _view(b"x" * CHUNK))
    done = threading.Event()

    def third() -> None:
        feed.put("p", 2 * CHUNK, _view(b"x" * CHUNK))
        done.set()

    t = threading.Thread(target=third)
    t.start()
    assert not done.wait(0.2)  # full: it waits (and CRIU behind it)
    feed.release("p", 0)
    assert done.wait(5)
    t.join()

    errors: list[BaseException] = []

    def fourth() -> None:
        try:
            feed.put("p", 3 * CHUNK, _view(b"x" * CHUNK))
        except TransferError as e:
            errors.append(e)

    t = threading.Thread(target=fourth)
    t.start()
    feed.fail("the transfer ended before the dump did")
    t.join(5)
    assert not t.is_alive() and "the transfer ended" in str(errors[0])
    with pytest.raises(TransferError):
        feed.put("q", 0, _view(b""))  # (an empty image too: nothing more is taken)


def test_a_chunk_larger_than_the_transfers_is_refused() -> None:
    with pytest.raises(TransferError, match="larger"):
        Feed(CHUNK, 4 * CHUNK).put("p", 0, _view(b"x" * (CHUNK + 1)))


def test_a_sender_reads_fed_images_beside_files_and_frees_them_as_acknowledged(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "carried.tar").write_bytes(b"t" * 5)
    (tmp_path / "manifest.json").write_text("{}")
    feed = Feed(CHUNK, 4 * CHUNK)
    files = Files(tmp_path, CHUNK, feed)
    state = SendState(CHUNK, 3)
    state.on_acked = lambda i: files.release(*state.chunks[i][:2])
    feed.put("pages-1.img", 0, _view(b"p" * CHUNK))
    feed.put("pages-1.img", CHUNK, _view(b"q" * 3))
    feed.put("empty.img", 0, _view(b""))
    state.add(files.grown(final=True))
    buf = bytearray(CHUNK)
    read = {files.names[fi]: bytes(files.read(fi, off, n, buf) or b"") for fi, off, n in state.chunks if off == 0}
    assert read == {"images/carried.tar": b"t" * 5, "images/pages-1.img": b"p" * CHUNK, "manifest.json": b"{}"}
    sizes = {"images/carried.tar": 5, "manifest.json": 2, "images/pages-1.img": CHUNK + 3, "images/empty.img": 0}
    assert dict(files.layout().files) == sizes
    for i in range(len(state.chunks)):
        state.ack(i, True)
    assert feed.kept == {} and feed.held == 0
    files.close()
