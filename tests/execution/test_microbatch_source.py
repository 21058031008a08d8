"""MicrobatchSource: each step's micro-batches read once, in order, and served by index."""

from megatron_bitpipe.execution.executor import MicrobatchSource


def test_micro_batches_are_read_once_in_order_whichever_index_is_asked_first():
    stream = iter([{"m": 0}, {"m": 1}, {"m": 2}, {"m": 3}])
    source = MicrobatchSource(stream, 3)
    assert next(source.iterator_for(1)) == {"m": 1}
    assert next(source.iterator_for(0)) == {"m": 0}
    source.finish()
    assert next(stream) == {"m": 3}  # the next step starts at its first item


def test_a_dict_micro_batch_read_twice_is_a_new_dict_each_time_over_the_same_values():
    """A forward step that replaces entries (megatron-core 0.19's get_batch_on_this_cp_rank cuts
    each tensor for this context-parallel rank that way) leaves the next reader the whole batch."""
    tokens = object()
    source = MicrobatchSource(iter([{"tokens": tokens}]), 1)
    first = next(source.iterator_for(0))
    first["tokens"] = "this rank's cut"
    second = next(source.iterator_for(0))
    assert second == {"tokens": tokens} and second["tokens"] is tokens and second is not first


def test_no_stream_serves_none_and_non_dict_items_as_they_are():
    assert MicrobatchSource(None, 2).iterator_for(0) is None
    item = ("tokens", "labels")
    assert next(MicrobatchSource([None, iter([item])], 1).iterator_for(0)) is item
