"""Weight formats and loading: safetensors, GGUF reading and conversion, quantization at load."""
