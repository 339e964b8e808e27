"""Quantization to the MX (microscaling) formats: `mx` holds the format (`quantize`,
`MXTensor`, `fake_quantize`, `mx_error_stats`), `linear` the MXFP8 linear layer
(`MXLinear`, `make_mxfp8_linear`). Imported lazily: ``from moe_lab.quant.mx import quantize``."""
