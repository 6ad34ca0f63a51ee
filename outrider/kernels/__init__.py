"""CPU kernels: the C sources per operation, their build and dispatch, and the quantized and float linear layers."""
