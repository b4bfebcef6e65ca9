"""Weight-only INT4 in compressed-tensors' pack-quantized layout (models/quant.py): the packed
weights, and the plain PyTorch that packs and unpacks them (the reference the W4A16 kernels of
moe_kernels.py are tested against).

A Linear of `out` x `in` is packed [out, in / 8] int32: element (o, i) is the signed 4-bit q in
[-8, 7], stored as q + 8 in bits 4 (i % 8) .. 4 (i % 8) + 3 of word (o, i // 8); its value is
q * scale[o, i // group_size]. Dequantized weights are rounded once, from float32, to the
activations' dtype: the kernels round the same way before their GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUES_PER_WORD = 8
# The group-interleaved order (interleave_int4): blocks of this many columns, groups of this size.
INTERLEAVE_BLOCK, INTERLEAVE_GROUP = 256, 32


@dataclass
class PackedInt4:
    """The INT4 weights of a stack of Linears (E experts): packed int32 [..., out, in / 8] and
    scale [..., out, in / group_size] (a 16-bit or 32-bit float), both contiguous. interleaved:
    the words hold their values in interleave_int4's order, not compressed-tensors'."""

    packed: torch.Tensor
    scale: torch.Tensor
    group_size: int
    interleaved: bool = False

    @property
    def out_features(self) -> int:
        return self.packed.shape[-2]

    @property
    def in_features(self) -> int:
        return self.packed.shape[-1] * VALUES_PER_WORD

    def check(self, name: str, lead: tuple[int, ...], out: int, in_: int, device: torch.device) -> None:
        """Raise, naming `name`, unless this holds [*lead, out, in] weights on `device`."""
        g = self.group_size
        want_packed = (*lead, out, in_ // VALUES_PER_WORD)
        want_scale = (*lead, out, in_ // g) if g and in_ % g == 0 else None
        if in_ % VALUES_PER_WORD or want_scale is None:
            raise ValueError(f"{name}: {in_} input columns must be a multiple of 8 and of group_size={g}")
        if g % VALUES_PER_WORD:  # the kernels read one scale per packed word
            raise ValueError(f"{name}: group_size={g} must be a multiple of 8")
        if self.interleaved and not interleave_fits(g, in_):
            raise ValueError(f"{name}: interleaved INT4 needs group_size={INTERLEAVE_GROUP} and input columns a "
                             f"positive multiple of {INTERLEAVE_BLOCK}, got {g} and {in_}")
        if self.packed.dtype != torch.int32 or tuple(self.packed.shape) != want_packed:
            raise ValueError(f"{name}.packed must be int32 {list(want_packed)}, got {self.packed.dtype} "
                             f"{list(self.packed.shape)}")
        if not self.scale.is_floating_point() or tuple(self.scale.shape) != want_scale:
            raise ValueError(f"{name}.scale must be a float {list(want_scale)}, got {self.scale.dtype} "
                             f"{list(self.scale.shape)}")
        for part in ("packed", "scale"):
            t = getattr(self, part)
            if not t.is_contiguous() or t.device != device:
                raise ValueError(f"{name}.{part} must be contiguous on {device}, got strides {t.stride()} on {t.device}")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., out, in / 8] -> int8 [..., out, in], each in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [..., out, in / 8, 8]: element i at nibble i % 8
    return (nibbles.flatten(-2) - 8).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 [..., out, in] in [-8, 7] (in a multiple of 8) -> int32 [..., out, in / 8]."""
    if values.dtype != torch.int8 or values.shape[-1] % VALUES_PER_WORD:
        raise ValueError(f"values must be int8 [..., in] with in a multiple of 8, got {values.dtype} {list(values.shape)}")
    if values.numel() and (values.min() < -8 or values.max() > 7):
        raise ValueError("INT4 values must lie in [-8, 7]")
    nibbles = (values.to(torch.int32) + 8).unflatten(-1, (-1, VALUES_PER_WORD))
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int32)
    return (nibbles << shifts).sum(-1, dtype=torch.int32)  # disjoint bits: the sum is the OR


def interleave_fits(group_size: int, in_features: int) -> bool:
    """Whether weights of this group size and depth can take the group-interleaved order: group 32
    and a positive multiple of 256 input columns (the interleaved tiles' K loops run at least once)."""
    return (group_size == INTERLEAVE_GROUP and in_features >= INTERLEAVE_BLOCK
            and in_features % INTERLEAVE_BLOCK == 0)


def interleave_order(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [INTERLEAVE_BLOCK]: the column, within its block, of value v = 8 w + i (word w, bits
    4i .. 4i + 3) of the group-interleaved order. Nibbles i and i + 4 of word w hold columns 2c and
    2c + 1 (c = w % 16) of group 4 (w // 16) + i % 4: one lop3 makes them one register of a K-pair,
    and the four groups of 16 words are one K = 128 dot (int4_interleaved.py)."""
    v = torch.arange(INTERLEAVE_BLOCK, device=device)
    word, i = v // VALUES_PER_WORD, v % VALUES_PER_WORD
    return INTERLEAVE_GROUP * (4 * (word // 16) + i % 4) + 2 * (word % 16) + i // 4


def interleave_int4(weights: PackedInt4) -> PackedInt4:
    """The same weights in the group-interleaved order (interleave_order): a permutation of each
    block's values, the scales unchanged. Needs group_size 32 and input columns a positive multiple
    of 256."""
    if weights.interleaved:
        return weights
    if not interleave_fits(weights.group_size, weights.in_features):
        raise ValueError(f"interleaved INT4 needs group_size={INTERLEAVE_GROUP} and input columns a positive "
                         f"multiple of {INTERLEAVE_BLOCK}, got {weights.group_size} and {weights.in_features}")
    return PackedInt4(reordered_words(weights.packed, to_interleaved=True), weights.scale, weights.group_size, True)


@torch.no_grad()
def reorder_words_(packed: torch.Tensor, to_interleaved: bool) -> None:
    """Permute int32 [..., in / 8] words in place, row slice by row slice (unpacked, a layer's
    weights are 8x their size), into the interleaved order or back to compressed-tensors'."""
    order = interleave_order(packed.device)
    rows = packed.view(-1, packed.shape[-1])
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    for start in range(0, rows.shape[0], 4096):
        part = rows[start : start + 4096]
        nibbles = ((part[..., None] >> shifts) & 0xF).flatten(-2).unflatten(-1, (-1, INTERLEAVE_BLOCK))
        if to_interleaved:
            nibbles = nibbles[..., order]
        else:
            nibbles = nibbles.clone().index_copy_(-1, order, nibbles)
        part.copy_((nibbles.flatten(-2).unflatten(-1, (-1, VALUES_PER_WORD)) << shifts).sum(-1, dtype=torch.int32))


def reordered_words(packed: torch.Tensor, to_interleaved: bool) -> torch.Tensor:
    """A copy of int32 [..., in / 8] words in the interleaved order or back (reorder_words_)."""
    words = packed.detach().clone()
    reorder_words_(words, to_interleaved)
    return words


def _values(weights: PackedInt4) -> torch.Tensor:
    """int8 [..., out, in] in column order, whichever order the words hold them in."""
    if not weights.interleaved:
        return unpack_int4(weights.packed)
    return unpack_int4(reordered_words(weights.packed, to_interleaved=False))


def dequantize_int4(weights: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
    """[..., out, in] in `dtype`: q * scale, in float32, rounded once."""
    q = _values(weights).float()
    scale = weights.scale.float().repeat_interleave(weights.group_size, dim=-1)
    return (q * scale).to(dtype)


def quantize_int4(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16) -> PackedInt4:
    """Symmetric group-wise INT4 of a float weight [..., out, in]: per group, scale = max |w| / 7
    (in scale_dtype), q = round(w / scale) clamped to [-8, 7]; for random benchmark weights and
    tests (checkpoints come packed)."""
    if weight.shape[-1] % group_size or group_size % VALUES_PER_WORD:
        raise ValueError(f"group_size {group_size} must be a multiple of 8 dividing {weight.shape[-1]} columns")
    groups = weight.float().unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(-1) / 7).clamp_min(1e-8).to(scale_dtype)
    q = (groups / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int8).flatten(-2)
    return PackedInt4(pack_int4(q).contiguous(), scale.contiguous(), group_size)
