"""The core's reserved point-to-point tags (mcrdl_core.base.tags): no two uses overlap, all
lie below MPI's smallest guaranteed tag bound, and consecutive calls on a group get
disjoint slots."""
from mcrdl_core.base import tags
from mcrdl_core.world.group import Group


def test_reserved_ranges_do_not_overlap_and_fit_mpi_bound():
    compress = set(range(tags.COMPRESS_BASE, tags.COMPRESS_BASE + tags.COMPRESS_SPAN))
    assert tags.RESHARD not in compress and tags.RESHARD_GO not in compress
    assert tags.RESHARD != tags.RESHARD_GO
    assert tags.RESERVED_BASE <= min(tags.RESHARD, tags.RESHARD_GO, tags.COMPRESS_BASE)
    assert tags.COMPRESS_BASE + tags.COMPRESS_SPAN - 1 <= 32767


def test_slots_are_disjoint_and_local_tags_stay_in_their_slot():
    seen = {}
    for slot in range(tags.SLOTS):
        wire = {tags.compress_tag(slot, t) for t in range(0, 5000, 7)}
        assert wire <= set(range(tags.COMPRESS_BASE + slot * tags.SLOT_TAGS,
                                 tags.COMPRESS_BASE + (slot + 1) * tags.SLOT_TAGS))
        for w in wire:
            assert seen.setdefault(w, slot) == slot


def test_group_sequence_numbers_count_calls():
    g = Group(3, [0, 1, 2], 1)
    assert [g.next_seq() for _ in range(3)] == [0, 1, 2]
