"""The page allocator and block manager: the free list, admission by worst case, and errors
that name the request and the limit before anything changes."""

import pytest

from ddtree.engine import BlockManager, KVCacheFull, PageAllocator


def test_allocator_free_list():
    pages = PageAllocator(4)
    a = pages.allocate(3)
    assert sorted(a) == [0, 1, 2] and pages.num_free == 1
    pages.release(a[1:])
    assert pages.num_free == 3 and sorted(pages.allocate(3)) == [1, 2, 3]
    pages.release([0, 1, 2, 3])
    assert pages.num_free == 4
    with pytest.raises(KVCacheFull, match="asked for 5 KV pages, 4 of 4 free"):
        pages.allocate(5)
    assert pages.num_free == 4
    with pytest.raises(ValueError, match="released more often"):
        pages.release([0])


def test_block_manager_reserves_lazily_and_frees():
    blocks = BlockManager(num_pages=6, page_size=4, max_batch=2, pages_per_request=5)
    blocks.admit(0, worst_rows=13, request_id="a")  # 4 pages promised
    assert not blocks.can_admit(worst_rows=9)  # 3 more would exceed 6
    blocks.admit(1, worst_rows=8, request_id="b")
    blocks.reserve([(0, 5, "a"), (1, 1, "b")])
    assert blocks.num_free == 3 and (blocks.table[0, :2] >= 0).all() and (blocks.table[0, 2:] == -1).all()
    blocks.reserve([(0, 13, "a")])
    assert len(blocks.pages(0)) == 4 and len(set(blocks.pages(0)) | set(blocks.pages(1))) == 5
    with pytest.raises(KVCacheFull, match="request a needs 5 KV pages for 17 slots, more than the 4 promised"):
        blocks.reserve([(0, 17, "a")])
    blocks.free(0)
    assert blocks.num_free == 5 and (blocks.table[0] == -1).all() and blocks.can_admit(worst_rows=16)


def test_running_out_of_pages_changes_nothing():
    """A reservation the pool cannot give raises naming the request and num_pages, and takes no page."""
    blocks = BlockManager(num_pages=3, page_size=4, max_batch=2, pages_per_request=4)
    blocks._promised.update({0: 4, 1: 4})  # an over-promised state, as a broken caller would make
    blocks._pages.update({0: [], 1: []})
    with pytest.raises(KVCacheFull, match=r"request y needs 2 KV pages for 8 slots; 3 of num_pages=3 are free \(4 wanted"):
        blocks.reserve([(0, 8, "x"), (1, 8, "y")][::-1])
    assert blocks.num_free == 3 and (blocks.table == -1).all()


def test_admission_refuses_what_can_never_fit():
    blocks = BlockManager(num_pages=8, page_size=4, max_batch=2, pages_per_request=3)
    with pytest.raises(KVCacheFull, match="request r may need 4 KV pages .* more than the 3 a block table holds"):
        blocks.admit(0, worst_rows=16, request_id="r")
