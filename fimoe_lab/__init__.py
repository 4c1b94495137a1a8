"""fimoe_lab: FlashInfer fused-MoE weight layouts as values you can apply, invert and draw."""

__version__ = "0.1.0"
