"""INT4 experts reordered on the GPU: the group-interleaved order (ops/int4.interleave_int4) that
fused_moe's interleaved tiles read, taken once after loading where those tiles run natively, and
never seen outside the device: state_dict, checkpoint writing, casts and moves see the checkpoint's
compressed-tensors order."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.int4 import reorder_words_, reordered_words
from ..ops.moe_int4 import interleavable


class InterleavedInt4Experts:
    """Mixed into layers.MoE (before nn.Module): its packed words' order, and the hooks that keep
    that order on the device. Needs the MoE's int4, w_gate_up_packed, w_down_packed and experts()."""

    int4_interleaved = False  # the packed words in interleave_int4's order

    @torch.no_grad()
    def interleave_int4_experts(self) -> bool:
        """Reorder the INT4 experts' words in place into int4.interleave_int4's order where fused_moe's
        interleaved tiles run natively (moe_int4.interleavable: sm_90, bf16, group 32, widths a
        positive multiple of 256); returns whether they are in that order now. Call once after loading, outside
        any CUDA graph capture (it synchronizes). state_dict, moves and casts see the checkpoint's
        order (_save_to_state_dict, _load_from_state_dict, _apply)."""
        if self.int4 is None or self.int4_interleaved:
            return self.int4_interleaved
        if not interleavable(*self.experts(), self.w_gate_up_packed.device):
            return False
        self._reorder(to_interleaved=True)
        return True

    def _reorder(self, to_interleaved: bool) -> None:
        """Both packed weights' words into the interleaved order or back, in place."""
        for packed in (self.w_gate_up_packed, self.w_down_packed):
            reorder_words_(packed.data, to_interleaved)
        self.int4_interleaved = to_interleaved

    def _apply(self, fn, recurse=True):
        # a cast or move the interleaved tiles cannot run on (float scales, the CPU) restores the order
        super()._apply(fn, recurse)
        if self.int4_interleaved and not interleavable(*self.experts(), self.w_gate_up_packed.device):
            self._reorder(to_interleaved=False)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.int4_interleaved:  # the state is the checkpoint's order, whatever the device holds
            for name in ("w_gate_up_packed", "w_down_packed"):
                destination[prefix + name] = reordered_words(destination[prefix + name], to_interleaved=False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.int4_interleaved and all(prefix + name in state_dict for name in ("w_gate_up_packed", "w_down_packed")):
            self._reorder(to_interleaved=True)  # loaded in the checkpoint's order into storage read as interleaved


def interleave_int4_experts(model: nn.Module) -> nn.Module:
    """Every INT4 MoE layer's experts in the interleaved order where its tiles run natively
    (InterleavedInt4Experts.interleave_int4_experts); returns the model."""
    for module in model.modules():
        if isinstance(module, InterleavedInt4Experts):
            module.interleave_int4_experts()
    return model
