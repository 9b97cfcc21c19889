"""Wire and storage formats: passthrough, MXFP8, block FP8 and NVFP4 codecs, the transform
hook.

Torch reference codecs run anywhere; on CUDA tensors the quantizers use Triton kernels
(refitd.formats.triton_kernels) when triton is installed, bit-identical to the reference.
"""

from refitd.formats import triton_kernels
from refitd.formats.fp8_block import (
    fp8_block_dequantize,
    fp8_block_dequantize_into,
    fp8_block_quantize,
    fp8_block_quantize_into,
)
from refitd.formats.mxfp8 import (
    mxfp8_dequantize,
    mxfp8_dequantize_into,
    mxfp8_quantize,
    mxfp8_quantize_into,
)
from refitd.formats.nvfp4 import (
    nvfp4_dequantize,
    nvfp4_dequantize_into,
    nvfp4_quantize,
    nvfp4_quantize_into,
)
from refitd.formats.passthrough import cast_copy
from refitd.formats.region import DestRegion, dest_region
from refitd.formats.segment import (
    copy_region,
    decode_raw_hashed,
    decode_raw_known_amax,
    decode_segment,
    encode_raw_amax,
    encode_segment,
    fold_amax,
)
from refitd.formats.transform import (
    FP8BlockTransform,
    MXFP8Transform,
    NVFP4Transform,
    RawTransform,
    Transform,
    TransformRegistry,
    default_registry,
    split_parts,
)

__all__ = [
    "DestRegion",
    "FP8BlockTransform",
    "MXFP8Transform",
    "NVFP4Transform",
    "RawTransform",
    "Transform",
    "TransformRegistry",
    "cast_copy",
    "copy_region",
    "decode_raw_hashed",
    "decode_raw_known_amax",
    "decode_segment",
    "default_registry",
    "dest_region",
    "encode_raw_amax",
    "encode_segment",
    "fold_amax",
    "fp8_block_dequantize",
    "fp8_block_dequantize_into",
    "fp8_block_quantize",
    "fp8_block_quantize_into",
    "mxfp8_dequantize",
    "mxfp8_dequantize_into",
    "mxfp8_quantize",
    "mxfp8_quantize_into",
    "nvfp4_dequantize",
    "nvfp4_dequantize_into",
    "nvfp4_quantize",
    "nvfp4_quantize_into",
    "split_parts",
    "triton_kernels",
]
