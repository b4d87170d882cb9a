"""SpecMask: grammar-constrained speculative decoding, built as services that scale apart."""
