"""pipeline_groups_of: found through wrappers, a clear error for chunks that lack them."""

from __future__ import annotations

import pytest
import torch

from megatron_bitpipe.execution.forward_backward import pipeline_groups_of


class _Wrapper(torch.nn.Module):
    """A DDP-like wrapper: megatron finds the wrapped model under ``module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def test_found_through_wrappers():
    inner = torch.nn.Linear(2, 2)
    inner.pipeline_groups = marker = object()
    assert pipeline_groups_of([_Wrapper(_Wrapper(inner))]) is marker


@pytest.mark.parametrize("model", [torch.nn.Linear(2, 2), _Wrapper(torch.nn.Linear(2, 2))], ids=["bare", "wrapped"])
def test_missing_names_build_chunks(model):
    with pytest.raises(ValueError, match="carry no pipeline_groups: build them with megatron_bitpipe.model.chunks.build_chunks"):
        pipeline_groups_of([model])


def test_none_names_build_chunks():
    inner = torch.nn.Linear(2, 2)
    inner.pipeline_groups = None
    with pytest.raises(ValueError, match="carry no pipeline_groups"):
        pipeline_groups_of([_Wrapper(inner)])
