"""How a checkpoint stores its routed experts: in 16 bits, or as compressed-tensors' packed INT4.

Kimi K2.6 (like Kimi-K2-Thinking) is published with its routed experts weight-only INT4 and every
other weight in bf16. Its config.json says so in compressed-tensors' terms:

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": [...], "weights": {"num_bits": 4, "type": "int",
            "symmetric": true, "strategy": "group", "group_size": 32}, "input_activations": null}},
        "ignore": [...]}

and each quantized Linear `P` is stored as `P.weight_packed` (int32 [out, in / 8]: eight signed
4-bit values per word along the input dimension, value + 8 in bits 4j .. 4j + 3 for element j),
`P.weight_scale` ([out, in / group_size], the checkpoint's 16-bit float) and `P.weight_shape`
(int [2]: out, in). The value of element (o, i) is (q - 8) * scale[o, i // group_size]. Which
Linears are quantized is read from the checkpoint's own tensors (a `weight_packed` where a
`weight` would be); this engine takes packed INT4 for the routed experts only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Int4Experts:
    """The routed experts' storage: symmetric INT4 in groups of `group_size` input columns."""

    group_size: int
    bits: int = 4


def expert_quantization(raw: dict) -> Int4Experts | None:
    """The scheme config.json's quantization_config gives (None: none given, 16-bit weights).
    Raises, naming the field and its value, for anything other than compressed-tensors'
    weight-only, symmetric, group-wise INT4 in the pack-quantized format."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise NotImplementedError(f"quantization_config.quant_method={method!r} is not supported: only compressed-tensors' "
                                  "pack-quantized INT4 routed experts are (Kimi K2.6's format); dequantize to bf16 first")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise NotImplementedError(f"quantization_config.config_groups has {len(groups)} schemes; one INT4 scheme is supported")
    (name, scheme), = groups.items()
    where = f"quantization_config.config_groups.{name}"
    fmt = scheme.get("format") or qc.get("format")
    if fmt != "pack-quantized":
        raise NotImplementedError(f"quantization_config.format={fmt!r} is not supported: only 'pack-quantized'")
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise NotImplementedError(f"{where} quantizes activations: only weight-only INT4 (W4A16) is supported")
    weights = scheme.get("weights") or {}
    wanted = {"type": "int", "num_bits": 4, "symmetric": True, "strategy": "group"}
    for key, value in wanted.items():
        got = weights.get(key, True if key == "symmetric" else None)
        if got != value:
            raise NotImplementedError(f"{where}.weights.{key}={got!r} is not supported: need {value!r} "
                                      "(symmetric group-wise INT4)")
    if weights.get("dynamic"):
        raise NotImplementedError(f"{where}.weights.dynamic=True is not supported: need static weight scales")
    group_size = weights.get("group_size")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 8 or group_size % 8:
        raise ValueError(f"{where}.weights.group_size={group_size!r}: need a positive multiple of 8 "
                         "(eight 4-bit values per packed word)")
    return Int4Experts(group_size)
