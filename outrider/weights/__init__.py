"""Weight formats and loading: safetensors, GGUF reading and conversion, quantization at load.

    loader.py        a model folder -> a Decoder (dtype, device, quantization choices)
    quant_load.py    where a quantized model's blocks come from (the GGUF, or float weights)
    quant_convert.py GGUF kinds beyond Q8_0/Q4_0/Q4_1 re-expressed exactly as our blocks
    gguf_index.py    a GGUF's tensor index and metadata, read fast
    gguf_convert.py  a GGUF -> a Hugging Face style folder (config, tokenizer, weights)
    tokenizer.py     a folder's tokenizer and end-of-generation ids
"""
