"""CPU kernels: C sources per operation, their build and dispatch, and the linear layers over them.

    csrc/                   the C sources: qmatmul.c (quantized x float rows), qmatmul_i8.c
                            (quantized x int8 rows, VNNI; qmatmul_i8_avx2.c: the same on AVX2),
                            matmul_amx.c (prefill on AMX tiles),
                            decoder_layer.c (a whole layer in one call), attention.c; isa.h
                            (which paths a build compiles: AVX-512, AVX2, or plain C)
    native.py               builds csrc/ once per machine and instruction-set variant, loads the
                            best the CPU runs, and wraps it (ctypes)
    variant_bench.py        the variants against each other: a decode step and a prefill
    blocks.py               the GGUF block formats in memory, with plain-torch quantize/dequantize
    quant_linear.py         a projection kept quantized: which kernel runs it, and the product
    cpu_linear.py           the float product x @ W.T, its path measured once per shape
    decoder_layer.py        the native decoder layer for few-row forwards
    qmatmul_i8_reference.py the int8-activation numerics in plain torch (qmatmul_i8.c's reference)
"""
