"""A wrapper's mode is its class: ``BatchDecodeWrapper(use_cuda_graph=True)`` is a
``GraphStableDecodeWrapper``, and only that one plans on the device. Constructing either does no
GPU work, so this runs anywhere."""

import pytest

from splitkv import BatchDecodeWrapper, GraphStableDecodeWrapper


def test_use_cuda_graph_gives_the_graph_stable_class():
    w = BatchDecodeWrapper(32, 8, 128, 16, use_cuda_graph=True, max_batch_size=4, max_num_pages=8)
    assert type(w) is GraphStableDecodeWrapper and isinstance(w, BatchDecodeWrapper)
    direct = GraphStableDecodeWrapper(32, 8, 128, 16, max_batch_size=4, max_num_pages=8)
    assert type(direct) is GraphStableDecodeWrapper and direct.use_cuda_graph
    assert type(BatchDecodeWrapper(32, 8, 128, 16)) is BatchDecodeWrapper


def test_the_graph_stable_class_refuses_to_be_per_shape():
    with pytest.raises(ValueError, match="use_cuda_graph: a GraphStableDecodeWrapper is "
                                         "graph-stable"):
        GraphStableDecodeWrapper(32, 8, 128, 16, use_cuda_graph=False, max_batch_size=4,
                                 max_num_pages=8)


def test_a_graph_stable_wrapper_needs_its_capacity():
    with pytest.raises(ValueError, match="max_num_pages: a graph-stable wrapper"):
        GraphStableDecodeWrapper(32, 8, 128, 16, max_batch_size=4)
