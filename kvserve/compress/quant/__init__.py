"""Weight quantization: grids (spec, rtn), packed formats (packing), the low-bit linear layer
(linear) and whole-model application (apply). See docs in each module."""
from kvserve.compress.quant.apply import (
                               METHODS,
                               QuantizeReport,
                               model_weight_bytes,
                               quantize_model,
)
from kvserve.weights.linear import QuantLinear, choose_kernel
from kvserve.weights.rtn import (
                               RTNQuantizer,
                               compute_qparams,
                               dequantize,
                               fake_quantize,
                               grid_qparams,
                               quantize,
                               quantize_rtn,
)
from kvserve.weights.spec import LayerQuantizer, LayerStats, QuantizedWeight, QuantSpec

__all__ = ["METHODS", "LayerQuantizer", "LayerStats", "QuantLinear", "QuantSpec", "QuantizeReport", "QuantizedWeight",
           "RTNQuantizer", "choose_kernel", "compute_qparams", "dequantize", "fake_quantize", "grid_qparams",
           "model_weight_bytes", "quantize", "quantize_model", "quantize_rtn"]
